// Drives `sandboxd mcp` over stdio with the MCP TypeScript SDK: lists the tools, runs a shell
// command (its output also streamed as progress notifications), and prints what came back as JSON.
//
//   node client.mjs SANDBOXD SOCKET WORKSPACE
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const [sandboxd, socket, workspace] = process.argv.slice(2);
const transport = new StdioClientTransport({
  command: sandboxd,
  args: ["mcp", "--socket", socket, "--workspace", workspace, "--approval", "never"],
  stderr: "inherit",
});
const client = new Client({ name: "sandboxd-ts-test", version: "1.0.0" });
// The SDK runs a notification's handler a microtask later but a response's at once: when a
// progress notification and the call's result come in one read (a loaded machine), the result
// removes the progress handler first and the SDK reports the notification as for "an unknown
// token". Such late ones are kept apart, with their message, so that the test can tell "sent before
// the result" from "never sent".
const late = [];
client.onerror = (error) => {
  const found = /progress notification for an unknown token: (.*)$/s.exec(error.message);
  if (found) late.push(JSON.parse(found[1]).params?.message ?? "");
  else console.error(error);
};
await client.connect(transport);
const tools = await client.listTools();
const progress = [];
const result = await client.callTool(
  { name: "shell", arguments: { command: "echo from-typescript; id -u; exit 4" } },
  undefined,
  { onprogress: (p) => progress.push(p.message ?? "") },
);
// The kernel's wall, from the same client: a write outside the workspace fails inside the
// sandbox; the same write inside the workspace works.
const outside = await client.callTool({ name: "shell", arguments: { command: "echo x > /etc/mcp-ts-probe" } });
const inside = await client.callTool({ name: "shell", arguments: { command: "echo x > ts-probe && cat ts-probe" } });
console.log(JSON.stringify({
  outside: outside.structuredContent,
  inside: inside.structuredContent,
  tools: tools.tools.map((tool) => tool.name),
  shellSchema: tools.tools.find((tool) => tool.name === "shell")?.inputSchema,
  result,
  progress,
  late,
}));
await client.close();
