// sparrow._engine: the C++ side of the Python API (python/sparrow/__init__.py, docs/python.md). One class,
// Engine (api/llm.h), whose calls take and give plain Python values: prompts as str or list[int],
// sampling parameters as a JSON object of vLLM's SamplingParams fields (checked by the server's parser),
// results as dicts that python/sparrow builds its vLLM-shaped classes from. The GIL is released while the
// engine runs; a sparrow::Error becomes a ValueError carrying its message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "api/llm.h"
#include "core/error.h"

namespace py = pybind11;
using sparrow::api::Llm;
using sparrow::api::LlmOptions;

namespace {

py::object logprob_dict(const sparrow::TokenLogprob& lp) {
  py::dict top;  // token -> (logprob, rank): the sampled token first, then the most likely
  top[py::int_(lp.token)] = py::make_tuple(lp.logprob, lp.rank);
  int64_t rank = 1;
  for (const auto& [token, logprob] : lp.top) {
    if (!top.contains(py::int_(token))) top[py::int_(token)] = py::make_tuple(logprob, rank);
    ++rank;
  }
  return std::move(top);
}

py::list results_list(const std::vector<sparrow::api::RequestResult>& results) {
  py::list out;
  for (const auto& r : results) {
    py::dict d;
    d["request_id"] = r.request_id;
    d["prompt"] = r.prompt;
    d["prompt_token_ids"] = r.prompt_token_ids;
    d["num_cached_tokens"] = r.num_cached_tokens;
    if (r.prompt_logprobs.empty()) {
      d["prompt_logprobs"] = py::none();
    } else {
      py::list prompt_logprobs;
      for (const auto& lp : r.prompt_logprobs) prompt_logprobs.append(lp ? logprob_dict(*lp) : py::none());
      d["prompt_logprobs"] = prompt_logprobs;
    }
    py::list outputs;
    for (const auto& c : r.outputs) {
      py::dict o;
      o["index"] = c.index;
      o["text"] = py::bytes(c.text).attr("decode")("utf-8", "replace");
      o["token_ids"] = c.token_ids;
      o["finish_reason"] = c.finish_reason;
      if (!c.stop_reason) o["stop_reason"] = py::none();
      else if (const auto* s = std::get_if<std::string>(&*c.stop_reason)) o["stop_reason"] = *s;
      else o["stop_reason"] = std::get<int32_t>(*c.stop_reason);
      o["cumulative_logprob"] = c.cumulative_logprob ? py::object(py::float_(*c.cumulative_logprob)) : py::none();
      if (c.cumulative_logprob) {
        py::list logprobs;
        for (const auto& lp : c.logprobs) logprobs.append(logprob_dict(lp));
        o["logprobs"] = logprobs;
      } else {
        o["logprobs"] = py::none();
      }
      outputs.append(o);
    }
    d["outputs"] = outputs;
    out.append(d);
  }
  return out;
}

std::vector<nlohmann::json> parse_params(const std::vector<std::string>& texts) {
  std::vector<nlohmann::json> params;
  for (const std::string& t : texts) params.push_back(nlohmann::json::parse(t));
  return params;
}

std::vector<sparrow::api::LoraRequest> lora_requests(const std::vector<std::pair<std::string, std::string>>& pairs) {
  std::vector<sparrow::api::LoraRequest> out;
  for (const auto& [name, path] : pairs) out.push_back({name, path});
  return out;
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "sparrow's engine (use the sparrow package: sparrow.LLM, sparrow.SamplingParams)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const sparrow::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.attr("__version__") = SPARROW_VERSION;
  py::class_<Llm>(m, "Engine")
      .def(py::init([](const std::string& model, const std::string& device, const std::string& load_format,
                       int64_t max_model_len, int64_t max_num_seqs, int64_t max_num_batched_tokens,
                       int64_t kv_cache_memory, double gpu_memory_utilization, const std::string& kv_cache_dtype,
                       int64_t block_size, bool enable_prefix_caching, bool enforce_eager, std::optional<uint64_t> seed,
                       const std::string& speculative_config, bool enable_lora, int64_t max_loras,
                       int64_t max_lora_rank, bool batch_invariant, const std::string& limit_mm_per_prompt,
                       const std::string& allowed_local_media_path) {
             LlmOptions o;
             o.model = model;
             o.device = device;
             o.load_format = load_format;
             o.max_model_len = max_model_len;
             o.max_num_seqs = max_num_seqs;
             o.max_num_batched_tokens = max_num_batched_tokens;
             o.kv_cache_memory = kv_cache_memory;
             o.gpu_memory_utilization = gpu_memory_utilization;
             o.kv_cache_dtype = kv_cache_dtype;
             o.block_size = block_size;
             o.enable_prefix_caching = enable_prefix_caching;
             o.enforce_eager = enforce_eager;
             o.seed = seed;
             o.speculative_config = speculative_config;
             o.enable_lora = enable_lora;
             o.max_loras = max_loras;
             o.max_lora_rank = max_lora_rank;
             o.batch_invariant = batch_invariant;
             o.limit_mm_per_prompt = limit_mm_per_prompt;
             o.allowed_local_media_path = allowed_local_media_path;
             py::gil_scoped_release release;
             return std::make_unique<Llm>(o);
           }),
           py::arg("model"), py::arg("device"), py::arg("load_format"), py::arg("max_model_len"),
           py::arg("max_num_seqs"), py::arg("max_num_batched_tokens"), py::arg("kv_cache_memory"),
           py::arg("gpu_memory_utilization"), py::arg("kv_cache_dtype"), py::arg("block_size"),
           py::arg("enable_prefix_caching"), py::arg("enforce_eager"), py::arg("seed"),
           py::arg("speculative_config"), py::arg("enable_lora"), py::arg("max_loras"), py::arg("max_lora_rank"),
           py::arg("batch_invariant"), py::arg("limit_mm_per_prompt"), py::arg("allowed_local_media_path"))
      .def("generate",
           [](Llm& llm, const std::vector<sparrow::api::Prompt>& prompts, const std::vector<std::string>& params,
              const std::vector<std::pair<std::string, std::string>>& loras,
              const std::vector<std::vector<py::bytes>>& images) {
             const std::vector<nlohmann::json> parsed = parse_params(params);
             std::vector<std::vector<std::string>> image_bytes;
             for (const auto& list : images) {
               image_bytes.emplace_back();
               for (const py::bytes& b : list) image_bytes.back().push_back(std::string(b));
             }
             std::vector<sparrow::api::RequestResult> results;
             {
               py::gil_scoped_release release;
               results = llm.generate(prompts, parsed, lora_requests(loras), image_bytes);
             }
             return results_list(results);
           })
      .def("chat",
           [](Llm& llm, const std::vector<std::string>& conversations, const std::vector<std::string>& params,
              const std::vector<std::pair<std::string, std::string>>& loras) {
             std::vector<nlohmann::ordered_json> parsed;
             for (const std::string& c : conversations) parsed.push_back(nlohmann::ordered_json::parse(c));
             const std::vector<nlohmann::json> sampling = parse_params(params);
             std::vector<sparrow::api::RequestResult> results;
             {
               py::gil_scoped_release release;
               results = llm.chat(parsed, sampling, lora_requests(loras));
             }
             return results_list(results);
           })
      .def("update_weights", static_cast<void (Llm::*)(const std::string&)>(&Llm::update_weights),
           py::call_guard<py::gil_scoped_release>())
      // [(name, safetensors dtype, shape, bytes), ...] (the Python side flattens each tensor to contiguous uint8):
      // the bytes are copied before the load.
      .def("update_weights_from_tensors",
           [](Llm& llm, const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, py::buffer>>& items) {
             std::vector<Llm::HostTensor> tensors;
             std::vector<py::buffer_info> views;  // held until the copy
             for (const auto& [name, dtype, shape, buffer] : items) {
               views.push_back(buffer.request());
               const py::buffer_info& view = views.back();
               SPARROW_CHECK(view.ndim == 1 && view.itemsize == 1 && (view.size <= 1 || view.strides[0] == 1),
                             "update_weights: '", name, "' must come as contiguous bytes");
               tensors.push_back({name, dtype, shape, view.ptr, size_t(view.size * view.itemsize)});
             }
             py::gil_scoped_release release;
             llm.update_weights(tensors);
           })
      // LoRA adapters as (name, path) pairs; an empty name: the base model.
      .def("load_lora",
           [](Llm& llm, const std::string& name, const std::string& path) { llm.load_lora({name, path}); },
           py::call_guard<py::gil_scoped_release>())
      .def("remove_lora", &Llm::remove_lora)
      .def("list_loras", &Llm::list_loras)
      .def_static("check_params", [](const std::string& params) { Llm::check_params(nlohmann::json::parse(params)); })
      .def("encode",
           [](const Llm& llm, const std::string& text) {
             SPARROW_CHECK(llm.tokenizer(), llm.model_path(), " has no tokenizer");
             return llm.tokenizer()->encode_with_special_tokens(text);
           })
      .def("decode",
           [](const Llm& llm, const std::vector<int32_t>& ids) {
             SPARROW_CHECK(llm.tokenizer(), llm.model_path(), " has no tokenizer");
             return py::bytes(llm.tokenizer()->decode(ids)).attr("decode")("utf-8", "replace");
           })
      .def_property_readonly("max_model_len", &Llm::max_model_len);
}
