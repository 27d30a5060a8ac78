// Thin pybind11 bindings of the C++ core. Arrays cross as numpy views (no copies out of a batch).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "block_manager.h"
#include "draft_policy.h"
#include "graph_staging.h"
#include "greedy_accept.h"
#include "ngram_proposer.h"
#include "scheduler.h"
#include "suffix_proposer.h"
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

using SeqIdArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

using BoolArray = py::array_t<bool, py::array::c_style | py::array::forcecast>;
using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// DraftLengthPolicy._arrays: (trials, accepts, asked, found, idle, probes, planned, pool_trials,
// pool_accepts), viewed in place, so each must already have its dtype and be C-contiguous.
using PolicyArrays = py::tuple;

template <typename T>
T* policy_array(const PolicyArrays& a, size_t i, py::ssize_t size) {
  using Array = py::array_t<T, py::array::c_style>;
  PE_CHECK(py::isinstance<Array>(a[i]), "draft policy array ", i, " has the wrong dtype or layout");
  auto arr = py::reinterpret_borrow<Array>(a[i]);
  PE_CHECK(arr.size() == size, "draft policy array ", i, " has ", arr.size(), " values, expected ", size);
  return arr.mutable_data();
}

DraftPolicyCounts policy_counts(const PolicyArrays& a) {
  PE_CHECK(a.size() == 9, "the draft policy's arrays: 9 expected, got ", a.size());
  const py::ssize_t k = py::len(a[7]), n = py::len(a[2]);
  return DraftPolicyCounts{policy_array<double>(a, 0, n * k), policy_array<double>(a, 1, n * k),
                           policy_array<double>(a, 2, n), policy_array<double>(a, 3, n),
                           policy_array<int64_t>(a, 4, n * k), policy_array<int64_t>(a, 5, n),
                           policy_array<int64_t>(a, 6, n), policy_array<double>(a, 7, k),
                           policy_array<double>(a, 8, k), n, static_cast<int32_t>(k)};
}

const int32_t* nonempty(const IntArray& tokens) {
  PE_CHECK(tokens.size() > 0, "cannot allocate an empty prompt");
  return tokens.data();
}

// The rows of a step launched ahead of a verify step's result (pyengine/engine/verify_ahead.py):
// for each running request seq_ids[i], whose drafts in flight are the next ext_counts[i] tokens of
// ext, predict(seq, drafts, m, limit, out) writes up to limit = 1 + min(lengths[i], k) tokens that
// would follow if all of them are accepted. Returns (tokens [rows, 1 + k], counts [rows]).
template <typename Predict>
py::tuple predict_rows(const Scheduler& s, const SeqIdArray& ids, const IntArray& ext, const IntArray& ext_counts,
                       const IntArray& lengths, Predict predict) {
  PE_CHECK(ids.size() == ext_counts.size() && ids.size() == lengths.size(),
           "seq_ids, draft counts and lengths differ in length");
  const int32_t k = s.config().num_spec_tokens;
  py::array_t<int32_t> out({static_cast<py::ssize_t>(ids.size()), static_cast<py::ssize_t>(k + 1)});
  py::array_t<int32_t> counts(ids.size());
  int64_t used = 0;
  for (py::ssize_t i = 0; i < ids.size(); ++i) {
    const int32_t m = ext_counts.data()[i];
    PE_CHECK(m >= 0 && used + m <= ext.size(), "draft counts exceed the drafts given");
    const int32_t limit = 1 + std::clamp<int32_t>(lengths.data()[i], 0, k);
    counts.mutable_data()[i] = static_cast<int32_t>(
        predict(s.sequence(ids.data()[i]), ext.data() + used, m, limit, out.mutable_data() + i * (k + 1)));
    used += m;
  }
  return py::make_tuple(out, counts);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyengine C++ core: block manager, scheduler, ngram proposer";
  py::register_exception<NoFreeBlocksError>(m, "NoFreeBlocksError", PyExc_RuntimeError);

  py::class_<KVAllocation>(m, "KVAllocation")
      .def(py::init<>())
      .def_readonly("block_table", &KVAllocation::block_table)
      .def_readonly("state_slots", &KVAllocation::state_slots)
      .def_readonly("allocated", &KVAllocation::allocated);

  py::class_<BlockManager>(m, "BlockManager")
      .def(py::init<int32_t, int32_t, bool, int32_t, int32_t, int32_t>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = true, py::arg("num_state_slots") = 0,
           py::arg("state_slots_per_seq") = 0, py::arg("num_state_checkpoints") = 0)
      .def("can_allocate", [](const BlockManager& b, IntArray t, int64_t lookahead, int64_t salt) {
             return b.can_allocate(nonempty(t), t.size(), lookahead, salt);
           }, py::arg("token_ids"), py::arg("lookahead") = 0, py::arg("cache_salt") = 0)
      .def("allocate", [](BlockManager& b, KVAllocation& a, IntArray t, int64_t lookahead, int64_t salt) {
             PE_CHECK(!a.allocated, "the allocation already holds blocks");
             return b.allocate(a, nonempty(t), t.size(), lookahead, salt);
           }, py::arg("alloc"), py::arg("token_ids"), py::arg("lookahead") = 0, py::arg("cache_salt") = 0)
      .def("can_append", &BlockManager::can_append, py::arg("alloc"), py::arg("num_computed"), py::arg("n"))
      .def("blocks_needed", &BlockManager::blocks_needed, py::arg("alloc"), py::arg("end"))
      .def("append", &BlockManager::append, py::arg("alloc"), py::arg("num_computed"), py::arg("n"))
      .def("cache_full_blocks", [](BlockManager& b, KVAllocation& a, IntArray t, int64_t num_valid) {
             PE_CHECK(num_valid <= t.size(), "num_valid (", num_valid, ") exceeds the ", t.size(), " tokens given");
             b.cache_full_blocks(a, t.data(), num_valid);
           }, py::arg("alloc"), py::arg("token_ids"), py::arg("num_valid"))
      .def("free", &BlockManager::free, py::arg("alloc"))
      .def("check_invariants", [](const BlockManager& b, const std::vector<const KVAllocation*>& live) {
             b.check_invariants(live);
           }, py::arg("live_allocs"))
#define PE_PROPERTY(name) .def_property_readonly(#name, &BlockManager::name)
#define PE_METHOD(name) .def(#name, &BlockManager::name)
      PE_PROPERTY(num_free_blocks) PE_PROPERTY(num_blocks) PE_PROPERTY(block_size) PE_PROPERTY(num_free_state_slots)
      PE_PROPERTY(num_state_checkpoints) PE_PROPERTY(num_used_state_checkpoints)
      PE_METHOD(checkpoint_slot_of_block) PE_METHOD(ref_count) PE_METHOD(block_has_hash) PE_METHOD(block_tokens) PE_METHOD(hashed_block_ids);
#undef PE_METHOD
#undef PE_PROPERTY

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init<>())
#define PE_FIELD(name) .def_readwrite(#name, &SchedulerConfig::name)
      PE_FIELD(max_num_seqs) PE_FIELD(max_num_batched_tokens) PE_FIELD(max_model_len) PE_FIELD(block_size)
      PE_FIELD(num_kv_blocks) PE_FIELD(enable_prefix_caching) PE_FIELD(enable_chunked_prefill)
      PE_FIELD(num_spec_tokens) PE_FIELD(drafter_lookahead) PE_FIELD(decode_lookahead) PE_FIELD(num_state_slots)
      PE_FIELD(num_state_checkpoints) PE_FIELD(state_checkpoint_interval);
#undef PE_FIELD

  py::class_<ScheduledBatch, std::shared_ptr<ScheduledBatch>>(m, "ScheduledBatch")
      .def_property_readonly("num_rows", &ScheduledBatch::num_rows)
      .def_property_readonly("num_tokens", [](const ScheduledBatch& b) { return b.input_ids.size(); })
      .def_readonly("num_decode_rows", &ScheduledBatch::num_decode_rows)
      .def_readonly("max_query_len", &ScheduledBatch::max_query_len)
      .def_readonly("max_context_len", &ScheduledBatch::max_context_len)
      .def_readonly("preempted_seq_ids", &ScheduledBatch::preempted_seq_ids)
      .def_readonly("num_state_saves", &ScheduledBatch::num_state_saves)
      .def_property_readonly("state_copies", [](py::object self) {
        const auto& b = self.cast<const ScheduledBatch&>();
        return view(b.state_copies, self, {static_cast<py::ssize_t>(b.state_copies.size() / 4), 4});
      })
      .def_property_readonly("state_copy_slots", [](py::object self) {
        const auto& b = self.cast<const ScheduledBatch&>();
        const auto n = static_cast<py::ssize_t>(b.state_copies.size() / 4);
        return view(b.state_copy_slots, self, {n, n ? static_cast<py::ssize_t>(b.state_copy_slots.size()) / n : 0});
      })
#define PE_VIEW(name) .def_property_readonly(#name, [](py::object self) { \
        return view(self.cast<const ScheduledBatch&>().name, self); })
      PE_VIEW(seq_ids) PE_VIEW(input_ids) PE_VIEW(positions) PE_VIEW(slot_mapping) PE_VIEW(query_start_loc)
      PE_VIEW(context_lens) PE_VIEW(num_computed) PE_VIEW(num_draft_tokens) PE_VIEW(cu_num_draft_tokens)
      PE_VIEW(num_logits) PE_VIEW(logits_indices) PE_VIEW(num_accepted_prev) PE_VIEW(request_slots)
      PE_VIEW(tokens_left)
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

  py::class_<DecodeView, std::shared_ptr<DecodeView>>(m, "DecodeView")
      .def_property_readonly("num_rows", &DecodeView::num_rows)
      .def_readonly("max_fewest_tokens_left", &DecodeView::max_fewest_tokens_left)
      .def_readonly("num_waiting", &DecodeView::num_waiting)
#define PE_VIEW(name) .def_property_readonly(#name, [](py::object self) { \
        return view(self.cast<const DecodeView&>().name, self); })
      PE_VIEW(seq_ids) PE_VIEW(request_slots) PE_VIEW(num_tokens) PE_VIEW(tokens_left);
#undef PE_VIEW

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig&>(), py::arg("config"))
      .def("add_request", &Scheduler::add_request, py::arg("seq_id"), py::arg("prompt_token_ids"),
           py::arg("max_tokens"), py::arg("eos_token_ids") = std::vector<int32_t>{},
           py::arg("stop_token_ids") = std::vector<int32_t>{}, py::arg("ignore_eos") = false,
           py::arg("cache_salt") = 0, py::arg("has_stop_strings") = false)
      .def("abort_request", &Scheduler::abort_request, py::arg("seq_id"))
      .def("set_draft_tokens", [](Scheduler& s, int64_t id, IntArray t) { s.set_draft_tokens(id, t.data(), t.size()); },
           py::arg("seq_id"), py::arg("draft_token_ids"))
      .def("set_draft_tokens_batch", [](Scheduler& s, SeqIdArray ids, IntArray flat, IntArray counts) {
             PE_CHECK(ids.size() == counts.size(), "seq_ids and counts differ in length");
             s.set_draft_tokens_batch(ids.data(), counts.data(), ids.size(), flat.data(), flat.size());
           }, py::arg("seq_ids"), py::arg("draft_token_ids"), py::arg("counts"))
      .def("fill_drafts", [](Scheduler& s, ScheduledBatch& batch, IntArray flat) {
             s.fill_drafts(batch, flat.data(), flat.size());
           }, py::arg("batch"), py::arg("draft_token_ids"))
      .def("propose_ngram", [](Scheduler& s, int32_t min_n, int32_t max_n, SeqIdArray ids, IntArray max_drafts) {
             PE_CHECK(ids.size() == max_drafts.size(), "seq_ids and max_drafts differ in length");
             s.propose_ngram(min_n, max_n, ids.data(), max_drafts.data(), ids.size());
           }, py::arg("min_n"), py::arg("max_n"), py::arg("seq_ids"), py::arg("max_drafts"))
      .def("propose_suffix", [](Scheduler& s, SuffixProposer& p, SeqIdArray ids, IntArray max_drafts) {
             // Suffix-decoding drafts (suffix_proposer.h) for these running decode requests, up to
             // max_drafts[i] each, set in one call.
             PE_CHECK(ids.size() == max_drafts.size(), "seq_ids and max_drafts differ in length");
             const int32_t k = s.config().num_spec_tokens;
             std::vector<int32_t> flat(static_cast<size_t>(ids.size()) * k), counts(ids.size());
             int64_t used = 0;
             for (py::ssize_t i = 0; i < ids.size(); ++i) {
               const Sequence& seq = s.sequence(ids.data()[i]);
               const auto limit = static_cast<int32_t>(
                   std::min<int64_t>(max_drafts.data()[i], s.max_useful_drafts(seq)));
               counts[i] = p.propose(seq.seq_id, seq.token_ids.data(), seq.num_tokens(), seq.num_prompt_tokens,
                                     std::max(limit, 0), flat.data() + used);
               used += counts[i];
             }
             s.set_draft_tokens_batch(ids.data(), counts.data(), ids.size(), flat.data(), used);
           }, py::arg("proposer"), py::arg("seq_ids"), py::arg("max_drafts"))
      .def("predict_suffix", [](const Scheduler& s, SuffixProposer& p, SeqIdArray ids, IntArray drafts,
                                IntArray num_drafts, IntArray lengths) {
             return predict_rows(s, ids, drafts, num_drafts, lengths,
                                 [&p](const Sequence& seq, const int32_t* ext, int32_t m, int32_t limit, int32_t* out) {
                                   return p.predict(seq.seq_id, seq.token_ids.data(), seq.num_tokens(),
                                                    seq.num_prompt_tokens, ext, m, limit, out);
                                 });
           }, py::arg("proposer"), py::arg("seq_ids"), py::arg("draft_token_ids"), py::arg("num_drafts"),
           py::arg("lengths"))
      .def("predict_ngram", [](const Scheduler& s, int32_t min_n, int32_t max_n, SeqIdArray ids, IntArray drafts,
                               IntArray num_drafts, IntArray lengths) {
             std::vector<int32_t> buf;
             return predict_rows(s, ids, drafts, num_drafts, lengths,
                                 [&](const Sequence& seq, const int32_t* ext, int32_t m, int32_t limit, int32_t* out) {
                                   buf.assign(seq.token_ids.begin(), seq.token_ids.end());
                                   buf.insert(buf.end(), ext, ext + m);
                                   return propose_ngram_tokens(buf.data(), static_cast<int64_t>(buf.size()), min_n,
                                                               max_n, limit, out);
                                 });
           }, py::arg("min_n"), py::arg("max_n"), py::arg("seq_ids"), py::arg("draft_token_ids"),
           py::arg("num_drafts"), py::arg("lengths"))
      .def("decode_view", &Scheduler::decode_view)
      .def("token_ids_from", [](const Scheduler& s, SeqIdArray ids, SeqIdArray starts) {
             // Each request's committed tokens from starts[i] on, concatenated, and the row offsets.
             PE_CHECK(ids.size() == starts.size(), "seq_ids and starts differ in length");
             std::vector<int32_t> flat;
             py::array_t<int64_t> offsets(ids.size() + 1);
             int64_t* off = offsets.mutable_data();
             off[0] = 0;
             for (py::ssize_t i = 0; i < ids.size(); ++i) {
               const std::vector<int32_t>& t = s.sequence(ids.data()[i]).token_ids;
               const int64_t from = std::clamp<int64_t>(starts.data()[i], 0, static_cast<int64_t>(t.size()));
               flat.insert(flat.end(), t.begin() + from, t.end());
               off[i + 1] = static_cast<int64_t>(flat.size());
             }
             return py::make_tuple(py::array_t<int32_t>(flat.size(), flat.data()), offsets);
           }, py::arg("seq_ids"), py::arg("starts"))
      .def("block_tables", [](const Scheduler& s, SeqIdArray ids) {
             // The requests' block tables as rows of one -1 padded matrix.
             size_t width = 0;
             for (py::ssize_t i = 0; i < ids.size(); ++i)
               width = std::max(width, s.sequence(ids.data()[i]).kv.block_table.size());
             py::array_t<int32_t> out({static_cast<size_t>(ids.size()), width});
             int32_t* row = out.mutable_data();
             for (py::ssize_t i = 0; i < ids.size(); ++i, row += width) {
               const std::vector<int32_t>& t = s.sequence(ids.data()[i]).kv.block_table;
               std::fill(std::copy(t.begin(), t.end(), row), row + width, -1);
             }
             return out;
           }, py::arg("seq_ids"))
      .def("schedule", &Scheduler::schedule)
      .def("update", [](Scheduler& s, IntArray tokens, IntArray counts) {
             UpdateResult r = s.update(tokens.data(), tokens.size(), counts.data(), counts.size());
             return py::make_tuple(py::array_t<int32_t>(r.num_committed.size(), r.num_committed.data()),
                                   py::array_t<int8_t>(r.finish_reason.size(), r.finish_reason.data()));
           }, py::arg("token_ids"), py::arg("counts"))
      .def("finished_outputs", [](const Scheduler& s) {
             const FinishedOutputs& f = s.finished_outputs();
             return py::make_tuple(py::array_t<int64_t>(f.seq_ids.size(), f.seq_ids.data()),
                                   py::array_t<int64_t>(f.cu_num_tokens.size(), f.cu_num_tokens.data()),
                                   py::array_t<int32_t>(f.token_ids.size(), f.token_ids.data()));
           })
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_free_blocks", [](const Scheduler& s) { return s.block_manager().num_free_blocks(); })
      .def_property_readonly("num_used_state_checkpoints",
                             [](const Scheduler& s) { return s.block_manager().num_used_state_checkpoints(); })
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
        d["prefix_cache_query_tokens"] = st.prefix_cache_query_tokens;
        d["num_state_checkpoints_saved"] = st.num_state_checkpoints_saved;
        d["num_state_restores"] = st.num_state_restores;
        d["num_draft_tokens"] = st.num_draft_tokens;
        d["num_accepted_tokens"] = st.num_accepted_tokens;
        d["num_verify_rows"] = st.num_verify_rows;
        d["num_verify_committed"] = st.num_verify_committed;
        d["accepted_per_position"] = st.accepted_per_position;
        d["drafted_per_position"] = st.drafted_per_position;
        return d;
      });

  py::class_<SuffixProposer>(m, "SuffixProposer")
      .def(py::init([](int32_t max_depth, float max_spec_factor, float min_token_prob, int64_t max_cached_tokens) {
             PE_CHECK(max_depth >= 1, "suffix max_depth must be >= 1, got ", max_depth);
             return SuffixProposer(SuffixConfig{max_depth, max_spec_factor, min_token_prob, max_cached_tokens});
           }), py::arg("max_depth") = 24, py::arg("max_spec_factor") = 1.0f, py::arg("min_token_prob") = 0.1f,
           py::arg("max_cached_tokens") = int64_t{1} << 20)
      .def("propose_tokens", [](SuffixProposer& p, int64_t seq_id, IntArray tokens, int32_t k, int64_t prompt_len) {
             std::vector<int32_t> out(std::max(k, 0));
             out.resize(p.propose(seq_id, tokens.data(), tokens.size(), prompt_len, std::max(k, 0), out.data()));
             return out;
           }, py::arg("seq_id"), py::arg("token_ids"), py::arg("k"), py::arg("prompt_len") = 0)
      .def("forget", &SuffixProposer::forget, py::arg("seq_id"), py::arg("finished"))
      .def_property_readonly("num_cached_tokens", &SuffixProposer::num_cached_tokens);

  // draft_policy.h: the policy's arrays (DraftLengthPolicy._arrays), updated in place
  m.def("observe_draft_rows", [](PolicyArrays a, SeqIdArray slots, IntArray num_drafts, IntArray num_committed,
                                 double decay, bool graph_steps) {
    const DraftPolicyCounts c = policy_counts(a);
    PE_CHECK(num_drafts.size() == slots.size() && num_committed.size() == slots.size(),
             "observe_draft_rows: slots, num_drafts and num_committed differ in length");
    const DraftPolicyObserved o = observe_draft_rows(c, slots.data(), num_drafts.data(), num_committed.data(),
                                                     slots.size(), decay, graph_steps);
    return py::make_tuple(o.asked_any, o.drafts_any, o.unfilled_probes_any);
  }, py::arg("arrays"), py::arg("slots"), py::arg("num_drafts"), py::arg("num_committed"), py::arg("decay"),
     py::arg("graph_steps"));
  m.def("padded_draft_lengths", [](PolicyArrays a, SeqIdArray slots, BoolArray eligible, DoubleArray cost, bool closed,
                                   double margin, double prior_weight) {
    // the lengths of a graph-replayed step (int64, one per row)
    const DraftPolicyCounts c = policy_counts(a);
    PE_CHECK(eligible.size() == slots.size(), "padded_draft_lengths: slots and eligible differ in length");
    PE_CHECK(cost.size() > c.k, "padded_draft_lengths: ", cost.size(), " step costs for k = ", c.k);
    py::array_t<int64_t> lengths(slots.size());
    padded_draft_lengths(c, slots.data(), eligible.data(), slots.size(), cost.data(), closed, margin, prior_weight,
                         lengths.mutable_data());
    return lengths;
  }, py::arg("arrays"), py::arg("slots"), py::arg("eligible"), py::arg("cost"), py::arg("closed"), py::arg("margin"),
     py::arg("prior_weight"));
  m.def("schedule_probes", [](PolicyArrays a, SeqIdArray slots, BoolArray eligible,
                              py::array_t<int64_t, py::array::c_style> lengths, double interval, bool graph_steps,
                              int64_t steps, int64_t last_probe_step, int64_t probe_every, int64_t probe) {
    // lengths updated in place; (due, last_probe_step)
    const DraftPolicyCounts c = policy_counts(a);
    PE_CHECK(eligible.size() == slots.size() && lengths.size() == slots.size(),
             "schedule_probes: slots, eligible and lengths differ in length");
    const ProbeSchedule p = schedule_probes(c, slots.data(), eligible.data(), slots.size(), lengths.mutable_data(),
                                            interval, graph_steps, steps, last_probe_step, probe_every, probe);
    return py::make_tuple(p.due, p.last_probe_step);
  }, py::arg("arrays"), py::arg("slots"), py::arg("eligible"), py::arg("lengths").noconvert(), py::arg("interval"),
     py::arg("graph_steps"), py::arg("steps"), py::arg("last_probe_step"), py::arg("probe_every"), py::arg("probe"));

  m.def("launch_rows", [](SeqIdArray first, IntArray counts, IntArray tables, int64_t block_size,
                          int64_t max_context) -> py::object {
    // graph_staging.h: (query_start_loc, positions, slot_mapping, context_lens, num_blocks) or None
    const py::ssize_t rows = counts.size();
    PE_CHECK(first.size() == rows && tables.ndim() == 2 && tables.shape(0) >= rows,
             "launch_rows: first, counts and the table rows must agree");
    LaunchRows out;
    if (!launch_rows(first.data(), counts.data(), rows, tables.data(), tables.shape(1), block_size, max_context, &out))
      return py::none();
    auto vec = [](const auto& v) { return py::array(v.size(), v.data()); };
    return py::make_tuple(vec(out.query_start_loc), vec(out.positions), vec(out.slot_mapping), vec(out.context_lens),
                          vec(out.num_blocks));
  }, py::arg("first"), py::arg("counts"), py::arg("tables"), py::arg("block_size"), py::arg("max_context"));

  m.def("stage_graph_step", [](py::array_t<int64_t, py::array::c_style> h64, py::array_t<int32_t, py::array::c_style> tables,
                               int64_t T, int64_t R, int64_t padded_rows, int64_t q, int64_t token_slots,
                               IntArray query_start_loc, std::optional<SeqIdArray> input_ids, SeqIdArray positions,
                               SeqIdArray slot_mapping, IntArray context_lens, IntArray block_tables) {
    // graph_staging.h: h64 and tables (CudaGraphRunner's np64, np32) written in place
    const py::ssize_t rows = context_lens.size();
    PE_CHECK(query_start_loc.size() == rows + 1, "stage_graph_step: ", query_start_loc.size(),
             " query starts for ", rows, " rows");
    const int64_t n = query_start_loc.data()[rows];
    PE_CHECK(positions.size() >= n && slot_mapping.size() >= n && (!input_ids || input_ids->size() >= n),
             "stage_graph_step: fewer token inputs than the ", n, " tokens of the step");
    PE_CHECK(tables.ndim() == 2 && h64.size() >= 3 * T + 2 * R + 1 && tables.shape(0) >= R,
             "stage_graph_step: the staging buffers are smaller than T and R");
    const int64_t width = block_tables.ndim() == 2 ? block_tables.shape(1) : 0;
    PE_CHECK(rows == 0 || (block_tables.ndim() == 2 && block_tables.shape(0) >= rows),
             "stage_graph_step: block tables must be [rows, width]");
    const GraphStagingBuffers buf{h64.mutable_data(), tables.mutable_data(), T, R, tables.shape(1)};
    const GraphStepInputs in{rows, query_start_loc.data(), input_ids ? input_ids->data() : nullptr, positions.data(),
                             slot_mapping.data(), context_lens.data(), block_tables.data(), width};
    stage_graph_step(buf, in, padded_rows, q, token_slots);
  }, py::arg("h64").noconvert(), py::arg("tables").noconvert(), py::arg("T"), py::arg("R"), py::arg("padded_rows"),
     py::arg("q"), py::arg("token_slots"), py::arg("query_start_loc"), py::arg("input_ids").none(true),
     py::arg("positions"), py::arg("slot_mapping"), py::arg("context_lens"), py::arg("block_tables"));

  m.def("greedy_accept", [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> argmax,
                            py::array_t<bool, py::array::c_style | py::array::forcecast> finite, IntArray num_logits,
                            IntArray num_drafts, IntArray query_start_loc, IntArray input_ids) {
    // greedy_accept.h: (tokens, counts, first_bad or None)
    const py::ssize_t rows = num_logits.size();
    PE_CHECK(finite.size() == argmax.size() && num_drafts.size() == rows && query_start_loc.size() >= rows,
             "greedy_accept: argmax / finite / per-row arrays differ in length");
    int64_t total = 0;
    for (py::ssize_t r = 0; r < rows; ++r) total += num_logits.data()[r];
    PE_CHECK(total <= argmax.size(), "greedy_accept: num_logits exceed the argmax rows");
    GreedyAccepted a = greedy_accept(argmax.data(), finite.data(), argmax.size(), num_logits.data(), num_drafts.data(),
                                     query_start_loc.data(), rows, input_ids.data(), input_ids.size());
    py::object bad = a.any_bad ? py::object(py::array_t<int64_t>(rows, a.first_bad.data())) : py::object(py::none());
    return py::make_tuple(py::array_t<int32_t>(a.tokens.size(), a.tokens.data()),
                          py::array_t<int32_t>(rows, a.counts.data()), bad);
  }, py::arg("argmax"), py::arg("finite"), py::arg("num_logits"), py::arg("num_drafts"), py::arg("query_start_loc"),
     py::arg("input_ids"));

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
