// Thin pybind11 bindings of the C++ core. Arrays cross as numpy views (no copies out of a batch).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <unordered_map>

#include "block_manager.h"
#include "ngram_proposer.h"
#include "scheduler.h"
#ifdef PYENGINE_WITH_KERNELS
#include "register_kernels.h"
#endif

namespace py = pybind11;
using namespace pyengine;

void register_cpu_ops(py::module_& m);  // csrc/cpu/bindings_cpu.cpp

namespace {

using IntArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A numpy view of a vector owned by `owner` (kept alive by numpy's base reference).
template <typename Vec>
py::array view(const Vec& v, py::handle owner, std::vector<py::ssize_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<py::ssize_t>(v.size())};
  return py::array_t<typename Vec::value_type>(shape, v.data(), owner);
}

// Test- and tool-facing BlockManager: the core keyed by request id.
class PyBlockManager {
 public:
  PyBlockManager(int32_t num_blocks, int32_t block_size, bool prefix, int32_t slots, int32_t per_seq)
      : bm_(num_blocks, block_size, prefix, slots, per_seq) {}

  bool can_allocate(IntArray tokens, int64_t lookahead, int64_t salt) const {
    PE_CHECK(tokens.size() > 0, "cannot allocate an empty prompt");
    return bm_.can_allocate(tokens.data(), tokens.size(), lookahead, salt);
  }
  int64_t allocate(int64_t id, IntArray tokens, int64_t lookahead, int64_t salt) {
    PE_CHECK(!allocs_.count(id), "request id ", id, " already holds blocks");
    KVAllocation a;
    int64_t cached = bm_.allocate(a, tokens.data(), tokens.size(), lookahead, salt);
    allocs_.emplace(id, std::move(a));
    return cached;
  }
  bool can_append(int64_t id, int64_t num_computed, int64_t n) const {
    return bm_.can_append(get(id), num_computed, n);
  }
  int64_t blocks_needed(int64_t id, int64_t end) const { return bm_.blocks_needed(get(id), end); }
  void append(int64_t id, int64_t num_computed, int64_t n) { bm_.append(get(id), num_computed, n); }
  void cache_full_blocks(int64_t id, IntArray tokens, int64_t num_valid) {
    PE_CHECK(num_valid <= tokens.size(), "num_valid (", num_valid, ") exceeds the ", tokens.size(), " tokens given");
    bm_.cache_full_blocks(get(id), tokens.data(), num_valid);
  }
  void free(int64_t id) {
    auto it = allocs_.find(id);
    PE_CHECK(it != allocs_.end(), "free of unknown request id ", id, " (double free?)");
    bm_.free(it->second);
    allocs_.erase(it);
  }
  std::vector<int32_t> block_table(int64_t id) const { return get(id).block_table; }
  std::vector<int32_t> state_slots(int64_t id) const { return get(id).state_slots; }
  std::vector<int64_t> seq_ids() const {
    std::vector<int64_t> ids;
    for (const auto& kv : allocs_) ids.push_back(kv.first);
    return ids;
  }
  void check_invariants() const {
    std::vector<const KVAllocation*> tables;
    for (const auto& kv : allocs_) tables.push_back(&kv.second);
    bm_.check_invariants(tables);
  }
  const BlockManager& core() const { return bm_; }

 private:
  KVAllocation& get(int64_t id) {
    auto it = allocs_.find(id);
    PE_CHECK(it != allocs_.end(), "unknown request id ", id);
    return it->second;
  }
  const KVAllocation& get(int64_t id) const { return const_cast<PyBlockManager*>(this)->get(id); }

  BlockManager bm_;
  std::unordered_map<int64_t, KVAllocation> allocs_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyengine C++ core: block manager, scheduler, ngram proposer";
  py::register_exception<NoFreeBlocksError>(m, "NoFreeBlocksError", PyExc_RuntimeError);

  py::class_<PyBlockManager>(m, "BlockManager")
      .def(py::init<int32_t, int32_t, bool, int32_t, int32_t>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = true, py::arg("num_state_slots") = 0,
           py::arg("state_slots_per_seq") = 0)
      .def("can_allocate", &PyBlockManager::can_allocate, py::arg("token_ids"), py::arg("lookahead") = 0,
           py::arg("cache_salt") = 0)
      .def("allocate", &PyBlockManager::allocate, py::arg("seq_id"), py::arg("token_ids"),
           py::arg("lookahead") = 0, py::arg("cache_salt") = 0)
      .def("can_append", &PyBlockManager::can_append, py::arg("seq_id"), py::arg("num_computed"), py::arg("n"))
      .def("blocks_needed", &PyBlockManager::blocks_needed, py::arg("seq_id"), py::arg("end"))
      .def("append", &PyBlockManager::append, py::arg("seq_id"), py::arg("num_computed"), py::arg("n"))
      .def("cache_full_blocks", &PyBlockManager::cache_full_blocks, py::arg("seq_id"), py::arg("token_ids"),
           py::arg("num_valid"))
      .def("free", &PyBlockManager::free, py::arg("seq_id"))
      .def("block_table", &PyBlockManager::block_table)
      .def("state_slots", &PyBlockManager::state_slots)
      .def("seq_ids", &PyBlockManager::seq_ids)
      .def("check_invariants", &PyBlockManager::check_invariants)
      .def_property_readonly("num_free_blocks", [](const PyBlockManager& b) { return b.core().num_free_blocks(); })
      .def_property_readonly("num_blocks", [](const PyBlockManager& b) { return b.core().num_blocks(); })
      .def_property_readonly("block_size", [](const PyBlockManager& b) { return b.core().block_size(); })
      .def_property_readonly("num_free_state_slots",
                             [](const PyBlockManager& b) { return b.core().num_free_state_slots(); })
      .def("ref_count", [](const PyBlockManager& b, int32_t id) { return b.core().ref_count(id); })
      .def("block_has_hash", [](const PyBlockManager& b, int32_t id) { return b.core().block_has_hash(id); })
      .def("block_tokens", [](const PyBlockManager& b, int32_t id) { return b.core().block_tokens(id); })
      .def("hashed_block_ids", [](const PyBlockManager& b) { return b.core().hashed_block_ids(); });

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init<>())
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len)
      .def_readwrite("block_size", &SchedulerConfig::block_size)
      .def_readwrite("num_kv_blocks", &SchedulerConfig::num_kv_blocks)
      .def_readwrite("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readwrite("enable_chunked_prefill", &SchedulerConfig::enable_chunked_prefill)
      .def_readwrite("num_spec_tokens", &SchedulerConfig::num_spec_tokens)
      .def_readwrite("drafter_lookahead", &SchedulerConfig::drafter_lookahead)
      .def_readwrite("num_state_slots", &SchedulerConfig::num_state_slots);

  py::class_<ScheduledBatch, std::shared_ptr<ScheduledBatch>>(m, "ScheduledBatch")
      .def_property_readonly("num_rows", &ScheduledBatch::num_rows)
      .def_property_readonly("num_tokens", [](const ScheduledBatch& b) { return b.input_ids.size(); })
      .def_readonly("num_decode_rows", &ScheduledBatch::num_decode_rows)
      .def_readonly("max_query_len", &ScheduledBatch::max_query_len)
      .def_readonly("max_context_len", &ScheduledBatch::max_context_len)
      .def_readonly("preempted_seq_ids", &ScheduledBatch::preempted_seq_ids)
#define PE_VIEW(name) .def_property_readonly(#name, [](py::object self) { \
        return view(self.cast<const ScheduledBatch&>().name, self); })
      PE_VIEW(seq_ids) PE_VIEW(input_ids) PE_VIEW(positions) PE_VIEW(slot_mapping) PE_VIEW(query_start_loc)
      PE_VIEW(context_lens) PE_VIEW(num_computed) PE_VIEW(num_draft_tokens) PE_VIEW(cu_num_draft_tokens)
      PE_VIEW(num_logits) PE_VIEW(logits_indices) PE_VIEW(num_accepted_prev)
#undef PE_VIEW
      .def_property_readonly("block_tables", [](py::object self) {
        const auto& b = self.cast<const ScheduledBatch&>();
        return view(b.block_tables, self, {b.num_rows(), b.max_blocks});
      })
      .def_property_readonly("state_slots", [](py::object self) {
        const auto& b = self.cast<const ScheduledBatch&>();
        py::ssize_t per = b.num_rows() ? static_cast<py::ssize_t>(b.state_slots.size()) / b.num_rows() : 0;
        return view(b.state_slots, self, {b.num_rows(), per});
      });

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig&>(), py::arg("config"))
      .def("add_request", &Scheduler::add_request, py::arg("seq_id"), py::arg("prompt_token_ids"),
           py::arg("max_tokens"), py::arg("eos_token_ids") = std::vector<int32_t>{},
           py::arg("stop_token_ids") = std::vector<int32_t>{}, py::arg("ignore_eos") = false,
           py::arg("cache_salt") = 0)
      .def("abort_request", &Scheduler::abort_request, py::arg("seq_id"))
      .def("set_draft_tokens", [](Scheduler& s, int64_t id, IntArray t) { s.set_draft_tokens(id, t.data(), t.size()); },
           py::arg("seq_id"), py::arg("draft_token_ids"))
      .def("set_draft_tokens_batch", [](Scheduler& s, py::array_t<int64_t, py::array::c_style | py::array::forcecast> ids,
                                        IntArray flat, IntArray counts) {
             PE_CHECK(ids.size() == counts.size(), "seq_ids and counts differ in length");
             s.set_draft_tokens_batch(ids.data(), counts.data(), ids.size(), flat.data(), flat.size());
           }, py::arg("seq_ids"), py::arg("draft_token_ids"), py::arg("counts"))
      .def("propose_ngram", &Scheduler::propose_ngram, py::arg("min_n"), py::arg("max_n"), py::arg("k"))
      .def("schedule", &Scheduler::schedule)
      .def("update", [](Scheduler& s, IntArray tokens, IntArray counts) {
             UpdateResult r = s.update(tokens.data(), tokens.size(), counts.data(), counts.size());
             return py::make_tuple(py::array_t<int32_t>(r.num_committed.size(), r.num_committed.data()),
                                   py::array_t<int8_t>(r.finish_reason.size(), r.finish_reason.data()));
           }, py::arg("token_ids"), py::arg("counts"))
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_free_blocks", [](const Scheduler& s) { return s.block_manager().num_free_blocks(); })
      .def("running_ids", &Scheduler::running_ids)
      .def("token_ids", [](const Scheduler& s, int64_t id) { return s.sequence(id).token_ids; })
      .def("num_computed", [](const Scheduler& s, int64_t id) { return s.sequence(id).num_computed; })
      .def("block_table", [](const Scheduler& s, int64_t id) { return s.sequence(id).kv.block_table; })
      .def("check_invariants", &Scheduler::check_invariants)
      .def("stats", [](const Scheduler& s) {
        const SchedulerStats st = s.stats();
        py::dict d;
        d["num_steps"] = st.num_steps;
        d["num_preemptions"] = st.num_preemptions;
        d["prefix_cache_hit_tokens"] = st.prefix_cache_hit_tokens;
        d["num_draft_tokens"] = st.num_draft_tokens;
        d["num_accepted_tokens"] = st.num_accepted_tokens;
        d["num_verify_rows"] = st.num_verify_rows;
        d["num_verify_committed"] = st.num_verify_committed;
        d["accepted_per_position"] = st.accepted_per_position;
        d["drafted_per_position"] = st.drafted_per_position;
        return d;
      });

  m.def("propose_ngram", [](IntArray tokens, int32_t min_n, int32_t max_n, int32_t k) {
    std::vector<int32_t> out(std::max(k, 0));
    out.resize(propose_ngram_tokens(tokens.data(), tokens.size(), min_n, max_n, k, out.data()));
    return out;
  }, py::arg("token_ids"), py::arg("min_n"), py::arg("max_n"), py::arg("k"));

  m.attr("FINISH_REASONS") = py::make_tuple(py::none(), "stop", "length", "abort");
  register_cpu_ops(m);
#ifdef PYENGINE_WITH_KERNELS
  register_kernels(m);
  m.attr("has_kernels") = true;
#else
  m.attr("has_kernels") = false;
#endif
}
