// The verify step after a greedy verify (or decode) step, built on the device from that step's
// argmax, so that it is launched before the host has seen the step's tokens (plain C++ interface;
// the kernels live in next_verify_step.hip; pyengine/engine/device_verify.py drives them and
// pyengine/ops/reference/next_verify_step.py is the reference).
//
// For each row r of step N (rows of the step just replayed, in its order):
//   1. sync: the history row (the request's tokens, one int32 row per request slot) receives
//      the tokens the host had and the device lacked;
//   2. accept: a = how many of the row's drafts equal the argmax at their positions, in order;
//      the bonus token is the argmax after the last one kept (csrc/core/greedy_accept.h's rule);
//      the drafts kept and the bonus are appended to the history after the row's first position;
//   3. draft: at most min(the row's max drafts, q - 1, tokens_left - a - 2) drafts, fewer where a
//      position has no block: the host's predicted drafts where it predicted this outcome (every
//      draft accepted and the bonus token it guessed), else the prompt lookup of
//      csrc/core/ngram_proposer.h over the history (the most recent earlier occurrence of the last
//      n tokens, n = max_n .. min_n; min_n = 0: no lookup);
//   4. stage: step N + 1's inputs in the graph's static buffer, laid out as
//      csrc/core/graph_staging.h stages them (each row's bonus and drafts from position
//      first + 1 + a, the rows packed, padding rows up to padded_rows owning the token slots after
//      them, q at most each, slot -1 and context 0).
// result[r] = [a, number of drafts, bonus, drafts ...] (stride result_stride) for the host.
// A drafting layer (MTP, EAGLE-3) drafts between the two halves: phase kAccept runs 1-3 with no
// drafts and leaves in result[r][1] how many the row may take (the limit of 3); the layer then
// drafts from the accepted tokens, and phase kLayerDrafts takes each row's first result[r][1]
// drafts from layer_drafts ([draft j][row r] at j * layer_stride + r) and runs 4.
// Every value is an integer comparison or copy: a row's result depends on its own inputs only.
#pragma once

#include <cstdint>

// Per-row fields of `rows_in` (int64, kRowFields + 2 max_drafts + 1 values a row).
enum NextVerifyRowField : int {
  kPrevStart = 0,     // the row's first token in step N (its index into argmax)
  kPrevDrafts = 1,    // d: the row's drafts in step N
  kFirstPosition = 2, // the position of the row's first token in step N
  kMaxDrafts = 3,     // the most drafts the row may get for step N + 1
  kTokensLeft = 4,    // the row's tokens left before step N commits
  kHistoryRow = 5,    // its row of the history
  kSyncFrom = 6,      // the first history position the sync writes
  kSyncCount = 7,     // how many tokens it writes
  kSyncOffset = 8,    // where they start in sync_tokens
  kPredicted = 9,     // predicted tokens: the bonus token guessed if every draft is accepted, then
                      // the drafts after it (0: no prediction)
  kRowFields = 10,    // then step N's drafts (max_drafts values), the predicted tokens (max_drafts + 1)
};

enum NextVerifyPhase : int32_t {
  kWhole = 0,        // 1-4 (the host's predictions or the prompt lookup)
  kAccept = 1,       // 1-3 without drafts: result[r][1] = the row's draft limit
  kLayerDrafts = 2,  // the drafts from layer_drafts, then 4
};

struct NextVerifyStepParams {
  const int64_t* argmax = nullptr;     // step N's argmax, one per token
  const int64_t* rows_in = nullptr;    // [rows, kRowFields + 2 max_drafts + 1]
  const int32_t* sync_tokens = nullptr;
  int32_t* history = nullptr;          // [slots, history_stride]
  int64_t history_stride = 0;
  const int32_t* block_tables = nullptr;  // the graph's static tables [padded_rows, table_width]
  int64_t table_width = 0;
  int64_t block_size = 0;
  int64_t max_context = 0;             // a row's context must stay within it
  // the graph's static int64 buffer: ids | positions | slots (T each) | context_lens | query_start_loc
  int64_t* inputs = nullptr;
  int64_t token_capacity = 0;          // T
  int64_t row_capacity = 0;            // R: context_lens holds R values, query_start_loc R + 1
  int64_t rows = 0;
  int64_t padded_rows = 0;             // the graph's rows (2b)
  int64_t q = 0;                       // the graph's query length: a row gets q - 1 drafts at most
  int64_t token_slots = 0;             // the graph's token slots
  int64_t max_drafts = 0;              // per-row draft fields of rows_in and result (>= q - 1)
  int64_t* result = nullptr;           // [rows, result_stride]
  int64_t result_stride = 0;           // 3 + max_drafts at least
  int32_t min_n = 1;                   // 0: no lookup
  int32_t max_n = 1;
  int32_t phase = kWhole;
  const int64_t* layer_drafts = nullptr;  // kLayerDrafts: [>= each row's limit][layer_stride]
  int64_t layer_stride = 0;
};

// 0 on success, -1 for a configuration the kernels do not take, or the runtime's error code.
int launch_next_verify_step(const NextVerifyStepParams& p, void* stream);
