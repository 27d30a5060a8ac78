// pybind11 bindings of the CPU layer ops (submodule pyengine._C.cpu). Tensors cross as raw data
// pointers (integers) with their sizes and row strides; pyengine/ops validates them first.
// The ops return an error message (empty on success) instead of throwing: see cpu_ops.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_llama_stack.h"
#include "cpu_ops.h"
#include "cpu_thread_pool.h"
#include "gguf_strings.h"

namespace py = pybind11;
using namespace pyengine::cpu;

namespace {

template <typename T = void>
T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

}  // namespace

void register_cpu_ops(py::module_& m) {
  py::module_ cpu = m.def_submodule("cpu", "CPU layer ops on raw pointers (see csrc/cpu/cpu_ops.h)");
  cpu.def("paged_attention",
          [](uintptr_t q, int64_t q_row_stride, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out, uintptr_t lse,
             uintptr_t block_tables, int64_t block_table_stride, uintptr_t query_start_loc, uintptr_t context_lens,
             int32_t num_rows, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
             int64_t num_blocks, float scale, int32_t dtype, bool use_pool, bool avx2_kernel) {
            PagedAttentionParams p;
            p.q = ptr(q), p.q_row_stride = q_row_stride, p.k_cache = ptr(k_cache), p.v_cache = ptr(v_cache);
            p.out = ptr(out), p.lse = ptr<float>(lse), p.block_tables = ptr<const int32_t>(block_tables);
            p.block_table_stride = block_table_stride, p.query_start_loc = ptr<const int32_t>(query_start_loc);
            p.context_lens = ptr<const int32_t>(context_lens), p.num_rows = num_rows, p.num_heads = num_heads;
            p.num_kv_heads = num_kv_heads, p.head_dim = head_dim, p.block_size = block_size;
            p.num_blocks = num_blocks, p.scale = scale;
            p.dtype = static_cast<DType>(dtype), p.use_pool = use_pool, p.avx2_kernel = avx2_kernel;
            return paged_attention(p);
          });
  cpu.def("rope_and_cache",
          [](uintptr_t qk, int64_t qk_row_stride, uintptr_t v, int64_t v_row_stride, uintptr_t cos, uintptr_t sin,
             uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping, int64_t num_slots, int32_t num_tokens, int32_t num_heads,
             int32_t num_kv_heads, int32_t head_dim, int32_t dtype, bool use_pool) {
            RopeAndCacheParams p;
            p.qk = ptr(qk), p.qk_row_stride = qk_row_stride, p.v = ptr(v), p.v_row_stride = v_row_stride;
            p.cos = ptr(cos), p.sin = ptr(sin), p.k_cache = ptr(k_cache), p.v_cache = ptr(v_cache);
            p.slot_mapping = ptr<const int64_t>(slot_mapping), p.num_slots = num_slots, p.num_tokens = num_tokens, p.num_heads = num_heads;
            p.num_kv_heads = num_kv_heads, p.head_dim = head_dim, p.dtype = static_cast<DType>(dtype);
            p.use_pool = use_pool;
            return rope_and_cache(p);
          });
  cpu.def("rms_norm", [](uintptr_t x, uintptr_t residual, uintptr_t out, uintptr_t weight, int32_t num_tokens,
                         int32_t hidden, float eps, int32_t dtype) {
    RmsNormParams p;
    p.x = ptr(x), p.residual = ptr(residual), p.out = ptr(out), p.weight = ptr(weight);
    p.num_tokens = num_tokens, p.hidden = hidden, p.eps = eps, p.dtype = static_cast<DType>(dtype);
    return rms_norm(p);
  });
  cpu.def("has_gemm", [](int32_t dtype) { return has_gemm(static_cast<DType>(dtype)); });
  cpu.def("gemm_isa", [](int32_t dtype) { return static_cast<int32_t>(gemm_isa(static_cast<DType>(dtype))); },
          "the packed GEMM's kernels for dtype here: 0 none, 2 AVX2 + FMA, 3 AVX-512");
  cpu.def("check_packed_weight", [](int64_t k, int64_t n, int32_t dtype) {
    return PackedWeight::check(k, n, static_cast<DType>(dtype));
  });
  cpu.def("set_num_threads", &set_pool_threads, "threads of the CPU ops' pool, the caller included");
  cpu.def("set_pool_adaptive", &set_pool_adaptive,
          "whether the pool runs jobs on the caller alone for a while after a descheduled worker held one up");
  cpu.def("set_pool_absent_fraction", &set_pool_absent_fraction,
          "workers that run under this fraction of their fair share of a window's chunks are held back (when "
          "adaptive; 0: never)");
  cpu.def("pool_stats", [] {
    const ThreadPool::Stats s = shared_pool().stats();
    return py::dict(py::arg("parallel_jobs") = s.parallel_jobs, py::arg("solo_jobs") = s.solo_jobs,
                    py::arg("stalls") = s.stalls, py::arg("chunks") = s.chunks,
                    py::arg("worker_chunks") = s.worker_chunks, py::arg("solo_periods") = s.solo_periods);
  }, "the shared pool's job counts since it was made (set_num_threads with a new count makes a new one)");
  cpu.def("pool_run_counts", [](int64_t n, int64_t busy_us) {
    // For tests: how many times run_chunks ran each of n chunks, and on how many threads.
    auto counts = std::make_unique<std::atomic<int>[]>(static_cast<size_t>(n));  // zeroed
    std::mutex mutex;
    std::set<std::thread::id> threads;
    {
      py::gil_scoped_release release;
      shared_pool().run_chunks(n, [&](int64_t i) {
        counts[i].fetch_add(1);
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(busy_us);
        while (std::chrono::steady_clock::now() < until) {}  // long enough for the workers to join in
        std::lock_guard<std::mutex> lock(mutex);
        threads.insert(std::this_thread::get_id());
      });
    }
    std::vector<int> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = counts[i].load();
    return py::make_tuple(out, threads.size());
  });
  py::class_<SoloBackoff>(cpu, "SoloBackoff", "the pool's policy (cpu_pool_policy.h: stalls, absent workers), for tests")
      .def(py::init<int>(), py::arg("num_threads") = 2)
      .def_static("stalled", &SoloBackoff::stalled, py::arg("own_us"), py::arg("waited_us"))
      .def("absent", &SoloBackoff::absent, py::arg("chunks"), py::arg("worker_chunks"))
      .def("set_absent_fraction", &SoloBackoff::set_absent_fraction, py::arg("fraction"))
      .def("parallel", &SoloBackoff::parallel, py::arg("now_us"))
      .def("on_parallel_job", &SoloBackoff::on_parallel_job, py::arg("now_us"), py::arg("was_stalled"),
           py::arg("chunks") = 0, py::arg("worker_chunks") = 0)
      .def_property_readonly("solo_us", &SoloBackoff::solo_us)
      .def_property_readonly("solo_periods", &SoloBackoff::solo_periods)
      .def_readonly_static("WINDOW_JOBS", &SoloBackoff::kWindowJobs)
      .def_readonly_static("MIN_SOLO_US", &SoloBackoff::kMinSoloUs)
      .def_readonly_static("MAX_SOLO_US", &SoloBackoff::kMaxSoloUs)
      .def_readonly_static("CLEAN_US", &SoloBackoff::kCleanUs)
      .def_readonly_static("STALL_SLACK_US", &SoloBackoff::kStallSlackUs);
  py::class_<PackedWeight>(cpu, "PackedWeight")
      .def(py::init([](uintptr_t w, int64_t k, int64_t n, int32_t dtype, bool compact, int32_t isa_limit) {
             return PackedWeight(ptr(w), k, n, static_cast<DType>(dtype), compact, static_cast<GemmIsa>(isa_limit));
           }),
           py::arg("w"), py::arg("k"), py::arg("n"), py::arg("dtype"), py::arg("compact") = true,
           py::arg("isa_limit") = 4)
      .def_property_readonly("k", &PackedWeight::k)
      .def_property_readonly("n", &PackedWeight::n)
      .def_property_readonly("format", [](const PackedWeight& self) { return static_cast<int32_t>(self.format()); },
                             "0 dense, 4 or 8: the bits per weight of cpu_gemm_affine.h's formats")
      .def_property_readonly("packed_bytes", &PackedWeight::packed_bytes)
      .def_property_readonly("int8_dot", &PackedWeight::int8_dot,
                             "packed from GGUF codes for cpu_gemm_qdot.h's int8 activations and integer dots")
      .def_property_readonly("qdot_act_bits", &PackedWeight::qdot_act_bits,
                             "cpu_gemm_qdot.h's activation bits (8, or 32: two int16 limbs); 0: not its panels")
      .def_property_readonly("isa", [](const PackedWeight& self) { return static_cast<int32_t>(self.isa()); },
                             "the kernels it runs: 2 AVX2 + FMA, 3 AVX-512 (int16 limbs: AVX-512 VNNI), 4 AMX (int16 limbs, from 4 rows)")
      .def("matmul", [](const PackedWeight& self, uintptr_t x, int64_t x_row_stride, int64_t m, uintptr_t bias,
                        uintptr_t y) {
        py::gil_scoped_release release;  // the pool's threads run while Python may do other work
        self.matmul(ptr(x), x_row_stride, m, ptr(bias), ptr(y));
      })
      .def("columns", [](const PackedWeight& self, uintptr_t ids, int64_t count, uintptr_t out) {
        // affine formats are fp32 weights only (cpu_gemm_affine.h)
        return self.columns(ptr<const int64_t>(ids), count, ptr<float>(out));
      }, "columns ids (count int64) as rows out [count, k] fp32 (cpu_gguf_pack.h); False for a dense format");
  cpu.def(
      "pack_gguf",
      [](int32_t ggml_type, uintptr_t row_addresses, int64_t k, int64_t n, bool int8_dot, int act_bits,
         int32_t isa_limit) -> py::object {
        const GgufRows rows{ggml_type, ptr<const uint8_t* const>(row_addresses)};
        std::optional<PackedWeight> w;
        {
          py::gil_scoped_release release;
          w = PackedWeight::from_gguf(rows, k, n, int8_dot ? 8 : act_bits, static_cast<GemmIsa>(isa_limit));
        }
        return w ? py::cast(std::move(*w)) : py::none();
      },
      "an fp32 [k, n] PackedWeight from n rows of GGUF blocks (row_addresses: n uint64 addresses; "
      "cpu_gguf_pack.h), or None where they cannot be packed; int8_dot: llama.cpp's arithmetic "
      "(cpu_gemm_qdot.h) where the CPU has it; else act_bits 32: its panels with activations as two "
      "int16 limbs (isa_limit: their best kernels up to 2 AVX2, 3 AVX-512 VNNI, 4 AMX; the same bits)",
      py::arg("ggml_type"), py::arg("row_addresses"), py::arg("k"), py::arg("n"), py::arg("int8_dot") = false,
      py::arg("act_bits") = 0, py::arg("isa_limit") = 4);
  cpu.def("gguf_string_starts", [](uintptr_t base, int64_t size, int64_t pos, int64_t count, uintptr_t starts) {
    return gguf_string_starts(ptr<const uint8_t>(base), size, pos, count, ptr<int64_t>(starts));
  }, "the body offsets of a GGUF string array (starts: count int64) and its end, -1 if it runs past size");
  py::class_<LlamaStack>(cpu, "LlamaStack")
      .def(py::init([](const py::list& layers, int32_t hidden, int32_t num_heads, int32_t num_kv_heads,
                       int32_t head_dim, int32_t intermediate, float eps, float scale, int32_t dtype) {
        // layers: (qkv, o, gate_up, down PackedWeights, input_norm, post_norm data pointers) each
        std::vector<LlamaLayerWeights> weights;
        for (const py::handle item : layers) {
          const auto t = item.cast<py::tuple>();
          LlamaLayerWeights w;
          w.qkv = t[0].cast<const PackedWeight*>(), w.o = t[1].cast<const PackedWeight*>();
          w.gate_up = t[2].cast<const PackedWeight*>(), w.down = t[3].cast<const PackedWeight*>();
          w.input_norm = ptr(t[4].cast<uintptr_t>()), w.post_norm = ptr(t[5].cast<uintptr_t>());
          weights.push_back(w);
        }
        return LlamaStack(std::move(weights), hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
                          static_cast<DType>(dtype));
      }))
      .def_property_readonly("num_layers", &LlamaStack::num_layers)
      .def("forward", [](const LlamaStack& self, uintptr_t h, uintptr_t residual, int32_t num_tokens, uintptr_t cos,
                         uintptr_t sin, uintptr_t slot_mapping, uintptr_t block_tables, int64_t block_table_stride,
                         uintptr_t query_start_loc, uintptr_t context_lens, int32_t num_rows, const py::list& k_caches,
                         const py::list& v_caches, int32_t block_size, int64_t num_blocks, bool use_pool,
                         uintptr_t positions, int64_t num_positions, uintptr_t final_norm,
                         std::vector<int32_t> aux_layers, uintptr_t aux, int64_t aux_row_stride,
                         bool attention_avx2) {
        LlamaStepParams p;
        p.aux_layers = std::move(aux_layers), p.aux = ptr(aux), p.aux_row_stride = aux_row_stride;
        p.positions = ptr<const int64_t>(positions), p.num_positions = num_positions, p.final_norm = ptr(final_norm);
        p.h = ptr(h), p.residual = ptr(residual), p.num_tokens = num_tokens, p.cos = ptr(cos), p.sin = ptr(sin);
        p.slot_mapping = ptr<const int64_t>(slot_mapping), p.block_tables = ptr<const int32_t>(block_tables);
        p.block_table_stride = block_table_stride, p.query_start_loc = ptr<const int32_t>(query_start_loc);
        p.context_lens = ptr<const int32_t>(context_lens), p.num_rows = num_rows;
        for (const py::handle c : k_caches) p.k_caches.push_back(ptr(c.cast<uintptr_t>()));
        for (const py::handle c : v_caches) p.v_caches.push_back(ptr(c.cast<uintptr_t>()));
        p.block_size = block_size, p.num_blocks = num_blocks, p.use_pool = use_pool;
        p.attention_avx2 = attention_avx2;
        py::gil_scoped_release release;
        return self.forward(p);
      }, py::arg("h"), py::arg("residual"), py::arg("num_tokens"), py::arg("cos"), py::arg("sin"),
      py::arg("slot_mapping"), py::arg("block_tables"), py::arg("block_table_stride"), py::arg("query_start_loc"),
      py::arg("context_lens"), py::arg("num_rows"), py::arg("k_caches"), py::arg("v_caches"), py::arg("block_size"),
      py::arg("num_blocks"), py::arg("use_pool"), py::arg("positions") = 0, py::arg("num_positions") = 0,
      py::arg("final_norm") = 0, py::arg("aux_layers") = std::vector<int32_t>{}, py::arg("aux") = 0,
      py::arg("aux_row_stride") = 0, py::arg("attention_avx2") = false);
  cpu.def("argmax_rows", [](uintptr_t x, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t tok,
                            uintptr_t finite) {
    argmax_rows(ptr<const float>(x), rows, cols, row_stride, ptr<int64_t>(tok), ptr<bool>(finite));
  }, "per row of fp32 x: tok (int64) = NumPy's argmax, finite (bool) = no NaN / inf (cpu_ops.h)");
  cpu.def("silu_and_mul", [](uintptr_t x, uintptr_t out, int32_t num_tokens, int32_t inter, int32_t dtype,
                             bool use_pool) {
    silu_and_mul(ptr(x), ptr(out), num_tokens, inter, static_cast<DType>(dtype), use_pool);
  });
}
