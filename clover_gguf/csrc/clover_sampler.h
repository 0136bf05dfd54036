// clover_sampler: clover-gguf's selection sampler, a backend sampler of llama.cpp's experimental backend sampling
// (struct llama_sampler_i with backend_init / backend_apply / backend_set_input / backend_reset, include/llama.h of
// the pinned tree), built beside llama.cpp against its public headers (clover_gguf/build.py) and loaded by the
// runtime (clover_gguf/llama_context.py). It changes nothing in llama.cpp: build_sampling, the other samplers and
// llama_get_logits_ith behave as upstream; this sampler only reads the rows llama.cpp computed.
//
// Per output row of its sequence it computes, in the decode's graph, what the runtime's selection needs, so that no
// full-vocabulary row travels to the host. First each given id's logit x becomes x * (x > 0 ? c0 : c1) + c2 (the
// coefficients per row and id; the identity when none are given). Then:
//  - greedy (temp <= 0): the rest of the vocabulary in m chunks of c consecutive ids
//    (c: clover_sampler_chunk(n_vocab)), the given ids left out: each chunk's largest logit and its token id, and
//    (probs) that logit's probability within its chunk; and the row's choice: the largest of the corrected logits and the chunk maxima, the lowest token id
//    among equal ones;
//    outputs (llama_get_sampled_*_ith): logits [W + m + 1] = [corrected at the ids | chunk maxima | the choice's],
//    candidates [W + m + 1] = the token id of each of those (the last: the choice), probs [m] (probs only);
//  - sampling (temp > 0): the row with the corrected logits is sampled: logits / temp, top_k (0: off), top_p (1: off),
//    a draw with the row's uniform u in [0, 1];
//    outputs: sampled = the drawn token, probs [W + 1] = the probabilities at the ids and of the drawn token under
//    the softmax of the corrected row at temperature 1, candidates [W + 1] = the ids and the drawn token.
// Additions (clover_sampler_init_ext, clover_sampler_set_inputs_ext; constrained output and logprobs):
//  - row restrictions (a grammar's mask): a row may be restricted to some of the given ids ("allow": every other
//    given id gets c2 = -inf and the rest of the row is excluded, a rest bias of -inf) or have some of them excluded
//    ("deny": c2 = -inf there); the chunk maxima, the choice, the draw and the top-n then see the restricted row;
//  - top_n: each row's top_n most likely tokens of the corrected (and restricted) row, appended to the outputs:
//    greedy logits/candidates [W + m + 1 + top_n] (their logits and ids, in no particular order); sampled, with
//    top_n > 0: probs/candidates [W + 1 + top_n] and logits [W + 1 + top_n], the corrected logits (temperature 1) at
//    the ids, the drawn token and the top_n;
//  - save_last: the raw logits of the last announced row of each decode are kept on the backend
//    (clover_sampler_saved_logit), for a token known only after the pass; a clone keeps its source's row.
// A width whose outputs would not fit llama.cpp's output row of n_vocab values is refused (init returns NULL):
// greedy W + m + 1 + top_n, sampled W + 1 + top_n at most n_vocab (llama.cpp aborts on more).
// The sampler must be the first in its chain (after a sampler that narrows or samples the row it refuses the call).
// It builds one computation over all of a sequence's output rows (llama_sampler_data.seq_logits, n_rows) and hands
// each call the slice of its llama_sampler_data.row, whose inputs it takes (the series' API patch 0010); a lone row
// without seq_logits is read as llama.cpp passes it. It refuses any call it does not know (clover_sampler.cpp's
// header lists them; among them several rows of a sequence without seq_logits): the call is marked
// refused, so llama_decode fails with -4 and runs nothing, and the reason goes to llama.cpp's log and
// clover_sampler_error returns it.
#pragma once

#include "llama.h"

#include <stdbool.h>
#include <stdint.h>

#if defined(_WIN32)
#    define CLOVER_SAMPLER_API __declspec(dllexport)
#else
#    define CLOVER_SAMPLER_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// width: W, the number of id slots per row (fixed per sampler, so that the graph keeps its shape while the ids
// change; unused slots repeat the first id). NULL for a bad argument (n_vocab outside [1, 2^24], width < 1,
// top_k < 0, top_p outside (0, 1], a non-finite temp, a width whose outputs do not fit a row: see above).
CLOVER_SAMPLER_API struct llama_sampler * clover_sampler_init(
        int32_t n_vocab, int32_t width, bool probs, float temp, int32_t top_k, float top_p);

// The most top_n may be (the OpenAI API's top_logprobs is at most 20).
#define CLOVER_SAMPLER_MAX_TOP_N 64

// clover_sampler_init with top_n (0..CLOVER_SAMPLER_MAX_TOP_N, and at most the chunk length when greedy) and
// save_last (see above). NULL for a bad argument.
CLOVER_SAMPLER_API struct llama_sampler * clover_sampler_init_ext(
        int32_t n_vocab, int32_t width, bool probs, float temp, int32_t top_k, float top_p, int32_t top_n,
        bool save_last);

// The inputs of the next decode, copied (the arrays may be freed when this returns); backend_set_input puts them
// into the graph. smpl: the sampler or a chain holding it. ids[n_ids]: token ids in [0, n_vocab),
// 1 <= n_ids <= width (n_ids may be 0 when n_rows is 0); n_rows: the output rows of the sampler's sequence in the
// next decode, in batch order (they must lie in one ubatch; at most the context's n_outputs_max_per_seq once the
// sampler is attached), 0 for a sequence outside it (the sampler then builds nothing on llama.cpp's rows);
// coef[3 * n_rows * n_ids] (c0 for every row and id, then c1, then c2), NULL for none (greedy only); with temp > 0
// also uniform[n_rows]. Returns 0, or -1 (and keeps the previous inputs) for a sampler that is not ours, an id out of
// range, a bad count (more rows than n_outputs_max_per_seq too), missing arrays or a uniform outside [0, 1].
CLOVER_SAMPLER_API int32_t clover_sampler_set_inputs(
        struct llama_sampler * smpl, const int32_t * ids, int32_t n_ids, int32_t n_rows,
        const float * coef, const float * uniform);

// clover_sampler_set_inputs with the coefficients of the first n_coef ids only (coef[3 * n_rows * n_coef], c0 for
// every row then c1 then c2; the other ids unchanged; coef NULL: none, also with temp > 0) and rows restricted by
// bitmasks (a grammar's): masks[n_masks * n_words] int32 words, token t allowed iff bit t % 32 of word t / 32 is set
// (bits past n_vocab ignored, ids past the words not allowed); row_mask[n_rows] each row's mask (-1: none; NULL: no
// row has one). A mask that allows fewer ids than it excludes restricts its rows to those ("allow"), else its
// excluded ids get c2 = -inf ("deny"); either way its ids (the allowed or the excluded) that are not among `ids` are
// taken out of the rows too, after them. Returns the number of ids taken (n_ids and those; at most the width), or -1
// (and keeps the previous inputs) for what set_inputs refuses, n_coef outside [0, n_ids], n_words < 1, a mask index
// outside [-1, n_masks), a mask allowing nothing, or more ids than the width.
CLOVER_SAMPLER_API int32_t clover_sampler_set_inputs_ext(
        struct llama_sampler * smpl, const int32_t * ids, int32_t n_ids, int32_t n_rows,
        const float * coef, int32_t n_coef, const float * uniform,
        const int32_t * masks, int32_t n_words, int32_t n_masks, const int32_t * row_mask);

// The raw logit of `token` in the last announced row of the latest decode that a save_last sampler took part in
// (the row as llama.cpp computed it, before any coefficient). 0, or -1 for a sampler without a saved row, a token
// out of range or no output pointer.
CLOVER_SAMPLER_API int32_t clover_sampler_saved_logit(struct llama_sampler * smpl, int32_t token, float * out);

// Why the sampler refused a call of the current sampling graph (the first such call), NULL when it refused none;
// cleared when the next graph is built. A refused call's row is left as llama.cpp gave it. Also, for the sampler's
// life, why it cannot select at all: backend_init found an op the device cannot run, or llama.cpp asked the host to
// select (the iface's apply: llama.cpp samples on the host when backend_init fails), which would be plain greedy. "not a clover sampler" for
// a sampler that is not ours. smpl: the sampler or a chain holding it.
CLOVER_SAMPLER_API const char * clover_sampler_error(struct llama_sampler * smpl);

// c, the chunk length of a vocabulary of n_vocab ids: the largest divisor of n_vocab up to 1024 (n_vocab itself
// when there is none from 64 up); 0 for n_vocab < 1.
CLOVER_SAMPLER_API int32_t clover_sampler_chunk(int32_t n_vocab);

#ifdef __cplusplus
}
#endif
