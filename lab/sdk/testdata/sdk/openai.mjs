// The official OpenAI Node SDK (package openai) through onceflow gateway: Chat
// Completions or Responses, plain or streamed. See lib.mjs for the input and output.
import OpenAI from 'openai';
import { collect, input, recordingFetch, requestOptions, run } from './lib.mjs';

const inp = input();
const attempts = [];
const client = new OpenAI({
  baseURL: inp.baseURL, // the gateway's /v1
  apiKey: inp.apiKey,
  maxRetries: inp.maxRetries ?? 2,
  timeout: inp.timeoutMs ?? 60000,
  fetch: recordingFetch(attempts),
});
const endpoint = { chat: client.chat.completions, responses: client.responses }[inp.api];
if (!endpoint) throw new Error(`openai.mjs: unknown api ${inp.api}`);
const params = inp.stream ? { ...inp.params, stream: true } : inp.params;
const options = requestOptions(inp);

await run(
  inp,
  attempts,
  async () => (inp.stream ? collect(await endpoint.create(params, options)) : { result: await endpoint.create(params, options) }),
  () => endpoint.create(params, options).asResponse(),
);
