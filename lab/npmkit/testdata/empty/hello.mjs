// Run by npmkit_test.go: prints its argument and whether node_modules is beside it.
import { existsSync } from 'node:fs';
import { greet } from './greet.mjs';

console.log(JSON.stringify({ greeting: greet(process.argv[2]), nodeModules: existsSync(new URL('./node_modules', import.meta.url)) }));
