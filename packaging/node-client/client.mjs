// Drive a sandboxd session from Node: create a session, run a command with stdin, print one JSON line.
// usage: node client.mjs SOCKET WORKSPACE
import path from "node:path";
import { fileURLToPath } from "node:url";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [socket, workspace] = process.argv.slice(2);
const here = path.dirname(fileURLToPath(import.meta.url));
const definition = protoLoader.loadSync("sandboxd/v1/sandboxd.proto", {
  includeDirs: [path.join(here, "..", "..", "protos")], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const { sandboxd } = grpc.loadPackageDefinition(definition);
const client = new sandboxd.v1.Sandbox(`unix:${socket}`, grpc.credentials.createInsecure());
const call = (method, request) => new Promise((resolve, reject) =>
  client[method](request, (error, reply) => (error ? reject(error) : resolve(reply))));

// approval_policy NEVER: this script has nobody to ask. With the default (ON_REQUEST) an unknown
// command is held until ResolveApproval answers it (watch WatchEvents for PermissionRequested).
const session = await call("CreateSession", { workspace, sandbox_policy: { mode: "WORKSPACE_WRITE" },
                                              approval_policy: "NEVER" });
const stream = client.Exec();
const out = { session_id: session.id, stdout: "", stderr: "", started_pid: 0, result: null };
stream.on("data", (message) => {
  if (message.kind === "started_pid") out.started_pid = message.started_pid;
  if (message.kind === "stdout") out.stdout += Buffer.from(message.stdout).toString();
  if (message.kind === "stderr") out.stderr += Buffer.from(message.stderr).toString();
  if (message.kind === "result") out.result = message.result;
});
stream.on("error", (error) => { console.error(error.message); process.exit(1); });
stream.on("end", async () => {
  await call("CloseSession", { session_id: session.id });
  console.log(JSON.stringify(out));
  client.close();
});
stream.write({ start: { session_id: session.id, shell: "cat; echo from-node-$(id -u) >&2; exit 5" } });
stream.write({ stdin: Buffer.from("hello from node\n") });
stream.write({ close_stdin: true });
stream.end();
