// `sparrow bench sweep`: one `bench serve` workload run at each of a list of concurrencies against one
// server (a running one, or `sparrow serve` started by the sweep itself), collected into one sweep JSON with
// the decode roofline of the served model beside every point (docs/bench.md, "Sweep and roofline";
// tools/plot_sweep.py draws it).
//
// The axes are InferenceX's (utils/process_result.py): interactivity = 1000 / TPOT(ms) = output tokens/s
// per user, and throughput per GPU = total (input + output) token throughput / GPUs; each point also has
// the mean-TPOT interactivity and the output-only throughput per GPU.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/roofline.h"
#include "bench/serve_bench.h"

namespace sparrow::bench {

struct SweepOptions {
  ServeBenchOptions serve;  // the workload and the client; max_concurrency and the counts are set per point
  std::vector<int64_t> concurrencies = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  // Requests per point: random sends concurrency x prompts_per_concurrency prompts, agentic runs
  // concurrency x sessions_per_concurrency sessions, unless the counts are fixed (--num-prompts,
  // --agentic-sessions given: serve.random.num_prompts / serve.agentic.sessions at every point).
  int64_t prompts_per_concurrency = 10;
  int64_t sessions_per_concurrency = 2;
  bool fixed_num_prompts = false, fixed_sessions = false;

  // --launch: arguments of `sparrow serve` (model folder and flags); the sweep starts it on a free port
  // (--port 0 unless given), waits for its start-up line, runs the points and stops it (SIGTERM).
  std::string launch;
  std::string sparrow_binary;       // the executable to launch (default: this process's own)
  double launch_timeout_s = 3600;   // dummy weights of a 100 GB shape take minutes to generate
  std::string server_log;           // where the launched server's output goes (default: <output>.server.log)

  // The roofline: the served model's config (a folder or config.json; default: --launch's model folder);
  // none → no roofline.
  std::string model_config;
  std::string kv_cache_dtype = "auto";  // the server's --kv-cache-dtype (the roofline's KV bytes)
  HardwareLimits hardware;
  // The server's layout (docs/parallel.md), for the roofline's shares and collectives: 0 takes --launch's
  // -tp / -dp flags, else tensor parallel over num_gpus. num_gpus 0: tensor x data parallel.
  int64_t tensor_parallel = 0, data_parallel = 0;
  int64_t num_gpus = 0;

  std::string label = "sparrow";  // the curve's name (the engine)
  std::string output;             // the sweep JSON (default: <result-dir>/sweep-<label>-<date>.json)
};

// Runs the sweep, prints each point's summary and a final table, writes the sweep JSON and returns it.
// A point whose every request failed is kept (with its first error) and the sweep goes on; a sweep in which
// no request completed at all is an error (after the file is written).
Json run_sweep(const SweepOptions& options);

// "1,2,4" -> {1, 2, 4}; errors name the flag.
std::vector<int64_t> parse_concurrencies(const std::string& text);
// Splits serve arguments on white space, honouring '...' and "..." quoting.
std::vector<std::string> split_arguments(const std::string& text);

// One point of the sweep from a `bench serve` (or `vllm bench serve`) result JSON: the InferenceX axes
// and the fields the plot reads. `concurrency` is the point's nominal concurrency.
Json sweep_point(const Json& result, int64_t concurrency, int64_t num_gpus);

}  // namespace sparrow::bench
