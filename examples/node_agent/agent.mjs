// A Node.js agent that spanrl trains without any spanrl code in it (producers/README.md,
// "Agents in production"): it calls the policy with the official `openai` client on the
// proxy's plain /v1, wraps each episode in an OpenTelemetry span exported with the JS SDK's
// default OTLP/HTTP exporter (OTLP/JSON) to the bridge, and posts the episode's reward to the
// bridge, which ends the rollout.
//
//   node agent.mjs --proxy http://127.0.0.1:18080 --bridge http://127.0.0.1:14318 \
//        [--model policy] [--episodes 2] [--task arith/17x23] [--token $SPANRL_AUTH_TOKEN]
//
// Episodes of one --task label form one GRPO group of --episodes rollouts (x-spanrl-task,
// x-spanrl-group-size). The proxy mints each episode's rollout id and answers it in the
// x-spanrl-rollout-id header; the agent span joins the call by trace (the W3C traceparent the
// agent sends with the call) and names the agent ("node-solver"). Prints one JSON line per
// episode: {"rollout_id", "answer", "reward"}.
import { parseArgs } from 'node:util';
import OpenAI from 'openai';
import { ROOT_CONTEXT, SpanKind, SpanStatusCode, context, propagation, trace } from '@opentelemetry/api';
import { W3CTraceContextPropagator } from '@opentelemetry/core';
import { BasicTracerProvider, BatchSpanProcessor } from '@opentelemetry/sdk-trace-base';
import { OTLPTraceExporter } from '@opentelemetry/exporter-trace-otlp-http';
import { resourceFromAttributes } from '@opentelemetry/resources';

const AGENT = 'node-solver';
const { values: opt } = parseArgs({
  options: {
    proxy: { type: 'string' }, bridge: { type: 'string' }, model: { type: 'string', default: 'policy' },
    episodes: { type: 'string', default: '2' }, task: { type: 'string', default: 'arith/17x23' },
    token: { type: 'string', default: process.env.SPANRL_AUTH_TOKEN ?? '' },
    'max-tokens': { type: 'string', default: '16' },
  },
});
if (!opt.proxy || !opt.bridge) {
  console.error('usage: node agent.mjs --proxy URL --bridge URL [--model NAME] [--episodes N] [--task LABEL]');
  process.exit(2);
}
const auth = opt.token ? { Authorization: `Bearer ${opt.token}` } : {};
const episodes = Number.parseInt(opt.episodes, 10);

// the task: a question with a checkable answer; reward 1 for the right number, else 0
const QUESTION = 'What is 17 * 23? Reply with the number only.';
const ANSWER = 17 * 23;
const rewardOf = (text) => (Number.parseInt((text.match(/-?\d+/) ?? [''])[0], 10) === ANSWER ? 1.0 : 0.0);

propagation.setGlobalPropagator(new W3CTraceContextPropagator());
const provider = new BasicTracerProvider({
  resource: resourceFromAttributes({ 'service.name': 'node-agent' }),
  spanProcessors: [new BatchSpanProcessor(new OTLPTraceExporter({ url: `${opt.bridge}/v1/traces`, headers: auth }))],
});
const tracer = provider.getTracer('spanrl-node-agent-example', '0.1.0');
const client = new OpenAI({ baseURL: `${opt.proxy}/v1`, apiKey: opt.token || 'unused', maxRetries: 0 });

async function postJson(url, body) {
  const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...auth },
                                 body: JSON.stringify(body) });
  if (!res.ok) throw new Error(`${url}: ${res.status} ${await res.text()}`);
  return res.json();
}

async function episode() {
  const span = tracer.startSpan(`invoke_agent ${AGENT}`, {
    kind: SpanKind.INTERNAL,
    attributes: { 'gen_ai.operation.name': 'invoke_agent', 'gen_ai.agent.name': AGENT },
  }, ROOT_CONTEXT);
  const ctx = trace.setSpan(ROOT_CONTEXT, span);
  const headers = { 'x-spanrl-task': opt.task, 'x-spanrl-group-size': String(episodes) };
  propagation.inject(ctx, headers);  // traceparent: the proxy records the call in this trace
  try {
    const { data, response } = await context.with(ctx, () => client.chat.completions.create({
      model: opt.model, max_tokens: Number.parseInt(opt['max-tokens'], 10), temperature: 1.0,
      messages: [{ role: 'user', content: QUESTION }],
    }, { headers }).withResponse());
    const rolloutId = response.headers.get('x-spanrl-rollout-id');
    const answer = data.choices[0].message.content ?? '';
    span.setAttribute('task.answer', answer);
    span.setStatus({ code: SpanStatusCode.OK });
    span.end();
    return { rollout_id: rolloutId, answer, reward: rewardOf(answer) };
  } catch (err) {
    span.recordException(err);
    span.setStatus({ code: SpanStatusCode.ERROR, message: String(err) });
    span.end();
    throw err;
  }
}

async function main() {
  const results = [];
  for (let i = 0; i < episodes; i++) results.push(await episode());
  await provider.forceFlush();  // the agent spans are in Kafka before the rewards end the rollouts
  for (const r of results) {
    await postJson(`${opt.bridge}/v1/rewards`, { rollout_id: r.rollout_id, value: r.reward });
    console.log(JSON.stringify(r));
  }
  await provider.shutdown();
}

main().catch((err) => { console.error(err); process.exit(1); });
