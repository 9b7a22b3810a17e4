// The official Anthropic TypeScript SDK (package @anthropic-ai/sdk) through onceflow
// gateway: Messages, plain or streamed. See lib.mjs for the input and output.
import Anthropic from '@anthropic-ai/sdk';
import { collect, input, recordingFetch, requestOptions, run } from './lib.mjs';

const inp = input();
if (inp.api !== 'messages') throw new Error(`anthropic.mjs: unknown api ${inp.api}`);
const attempts = [];
const client = new Anthropic({
  baseURL: inp.baseURL, // the gateway's root: the SDK appends /v1/messages
  apiKey: inp.apiKey,
  maxRetries: inp.maxRetries ?? 2,
  timeout: inp.timeoutMs ?? 60000,
  fetch: recordingFetch(attempts),
});
const params = inp.stream ? { ...inp.params, stream: true } : inp.params;
const options = requestOptions(inp);

await run(
  inp,
  attempts,
  async () => (inp.stream ? collect(await client.messages.create(params, options)) : { result: await client.messages.create(params, options) }),
  () => client.messages.create(params, options).asResponse(),
);
