// The few Node.js APIs cli.ts and bench.ts use, declared here so the TypeScript compiler stays the only
// dev dependency (no @types/node).
declare module "node:fs" {
  export function readFileSync(path: string): Uint8Array & { buffer: ArrayBuffer; byteOffset: number; byteLength: number };
  export function readFileSync(path: string, encoding: "utf8"): string;
  export function existsSync(path: string): boolean;
}
declare module "node:child_process" {
  export function execFileSync(file: string, args: string[], options?: { encoding?: "utf8"; cwd?: string; stdio?: unknown }): string;
}
declare const process: {
  argv: string[];
  env: Record<string, string | undefined>;
  exitCode?: number;
  cpuUsage(previous?: { user: number; system: number }): { user: number; system: number };
  stdout: { write(s: string): boolean };
  stderr: { write(s: string): boolean };
};
declare module "node:os" {
  export function availableParallelism(): number;
}
declare module "node:worker_threads" {
  export class Worker {
    constructor(url: URL | string, options?: unknown);
    postMessage(m: unknown): void;
    once(ev: "message" | "error" | "exit", cb: (v: any) => void): this;
    terminate(): Promise<number>;
    unref(): void;
  }
  export const parentPort: { postMessage(m: unknown): void; once(ev: "message", cb: (v: any) => void): void } | null;
}
