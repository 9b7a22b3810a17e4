// Shared by openai.mjs and anthropic.mjs, which gateway/sdk_test.go runs with
// `node SCRIPT.mjs INPUT`: INPUT is a JSON object (see run), the one line printed on
// stdout is the JSON result.

const t0 = Date.now();

// describe returns an error's class, message and code, then those of its causes.
export function describe(e) {
  const parts = [];
  for (let x = e, i = 0; x && i < 5; x = x.cause, i++) {
    parts.push(`${x.constructor?.name ?? 'Error'}: ${x.message ?? String(x)}${x.code ? ` (${x.code})` : ''}${x.status ? ` [HTTP ${x.status}]` : ''}`);
  }
  return parts.join(' <- ');
}

// recordingFetch is the SDK's fetch: it records every attempt the SDK makes (its
// X-Stainless-Retry-Count and Idempotency-Key headers, the status or the error, the
// times in ms since the start) into attempts.
export function recordingFetch(attempts) {
  return async (url, init = {}) => {
    const h = new Headers(init.headers);
    const a = {
      retryCount: h.get('x-stainless-retry-count') ?? '',
      idempotencyKey: h.get('idempotency-key') ?? '',
      atMs: Date.now() - t0,
    };
    attempts.push(a);
    try {
      const res = await fetch(url, init);
      a.status = res.status;
      a.replayed = res.headers.get('idempotent-replayed') ?? '';
      a.headersMs = Date.now() - t0;
      return res;
    } catch (e) {
      a.error = describe(e);
      a.headersMs = Date.now() - t0;
      throw e;
    }
  };
}

// run makes the call under test, once(), which returns {result} (an answer) or
// {events} (every event of a stream the SDK yielded); when it throws, the application
// calls again, inp.appRetries times at most, with the same Idempotency-Key (an SDK
// retries a failure before the answer's headers by itself, not a stream cut later).
// When inp.replay, the same request is then sent once more (raw(), the SDK's
// asResponse) and its status, Idempotent-Replayed header and body are reported.
// It prints {ok, calls, attempts, result | events, replay, elapsedMs} and exits.
export async function run(inp, attempts, once, raw) {
  const out = { ok: false, calls: [] };
  for (let i = 0; i <= (inp.appRetries ?? 0); i++) {
    const startedMs = Date.now() - t0;
    try {
      Object.assign(out, await once());
      out.calls.push({ ok: true, startedMs, endedMs: Date.now() - t0 });
      out.ok = true;
      break;
    } catch (e) {
      out.calls.push({ ok: false, startedMs, endedMs: Date.now() - t0, error: describe(e), status: e.status ?? 0 });
    }
  }
  out.elapsedMs = Date.now() - t0;
  out.attempts = attempts.slice();
  if (out.ok && inp.replay) {
    try {
      const res = await raw();
      out.replay = { status: res.status, replayed: res.headers.get('idempotent-replayed') ?? '', body: await res.text() };
    } catch (e) {
      out.replay = { error: describe(e) };
    }
  }
  process.stdout.write(JSON.stringify(out) + '\n', () => process.exit(0));
}

// collect reads a stream to its end.
export async function collect(stream) {
  const events = [];
  for await (const ev of stream) events.push(ev);
  return { events };
}

// input is the JSON object of the first argument:
//   baseURL, apiKey     where and as whom to call (baseURL as the SDK wants it)
//   idempotencyKey      sent as Idempotency-Key on every call ('' for none)
//   api                 chat | responses (openai.mjs), messages (anthropic.mjs)
//   stream              true for stream: true
//   params              the request body, stream aside
//   timeoutMs           the SDK's timeout (for the wait for the answer's headers)
//   maxRetries          the SDK's maxRetries (its default: 2)
//   appRetries          calls the application makes again after an error
//   replay              whether to ask again and report the raw answer
export function input() {
  const inp = JSON.parse(process.argv[2] ?? '{}');
  for (const k of ['baseURL', 'apiKey', 'api', 'params']) {
    if (!inp[k]) throw new Error(`input: ${k} is required`);
  }
  return inp;
}

// requestOptions are the per-request options of every call: the Idempotency-Key.
export function requestOptions(inp) {
  return inp.idempotencyKey ? { headers: { 'Idempotency-Key': inp.idempotencyKey } } : {};
}
