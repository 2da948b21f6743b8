// Drives `sandboxd mcp --gateway FILE` over stdio with the MCP TypeScript SDK, as an agent's client
// would: declares elicitation and sampling, lists the tools and prompts, makes the calls it is
// given, answers each elicitation with the next decision, and prints everything as JSON.
//
//   node gateway.mjs SPEC
//
// SPEC is JSON: {"command": "...", "args": [...], "env": {...}, "calls": [["TOOL", {ARGS}], ...],
// "decisions": ["allow_once", "deny", ...], "prompts": ["PROMPT", ...]}. An elicitation beyond the
// decisions is declined; every request the client receives (elicitation, sampling) is recorded,
// so a test sees what reached the person.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { CreateMessageRequestSchema, ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const spec = JSON.parse(process.argv[2]);
const transport = new StdioClientTransport({
  command: spec.command,
  args: spec.args,
  env: spec.env,
  stderr: "inherit",
});
const client = new Client(
  { name: "sandboxd-gateway-ts-test", version: "1.0.0" },
  { capabilities: { elicitation: {}, sampling: {} } },
);
const decisions = [...(spec.decisions ?? [])];
const received = [];
client.setRequestHandler(ElicitRequestSchema, async (request) => {
  received.push({ method: "elicitation/create", message: request.params.message });
  const decision = decisions.shift();
  return decision ? { action: "accept", content: { decision } } : { action: "decline" };
});
client.setRequestHandler(CreateMessageRequestSchema, async (request) => {
  received.push({ method: "sampling/createMessage", message: JSON.stringify(request.params.messages) });
  return { role: "assistant", content: { type: "text", text: "approve" }, model: "test" };
});
await client.connect(transport);
const tools = await client.listTools();
const prompts = client.getServerCapabilities()?.prompts ? (await client.listPrompts()).prompts : [];
const calls = [];
for (const [name, args] of spec.calls ?? []) {
  try {
    calls.push(await client.callTool({ name, arguments: args }));
  } catch (error) {
    calls.push({ protocolError: String(error?.message ?? error) });
  }
}
const gotPrompts = [];
for (const name of spec.prompts ?? []) {
  try {
    gotPrompts.push(await client.getPrompt({ name }));
  } catch (error) {
    gotPrompts.push({ protocolError: String(error?.message ?? error) });
  }
}
console.log(JSON.stringify({
  tools: tools.tools.map((tool) => ({ name: tool.name, description: tool.description ?? "" })),
  prompts: prompts.map((prompt) => ({ name: prompt.name, description: prompt.description ?? "" })),
  calls,
  gotPrompts,
  received,
}));
await client.close();
