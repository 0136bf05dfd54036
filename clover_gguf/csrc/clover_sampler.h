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
// The sampler must be the first in its chain (a sampler before it that narrows the candidates makes it a no-op).
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
// top_k < 0, top_p outside (0, 1], a non-finite temp).
CLOVER_SAMPLER_API struct llama_sampler * clover_sampler_init(
        int32_t n_vocab, int32_t width, bool probs, float temp, int32_t top_k, float top_p);

// The inputs of the next decode, copied (the arrays may be freed when this returns); backend_set_input puts them
// into the graph. smpl: the sampler or a chain whose first sampler it is. ids[n_ids]: token ids in [0, n_vocab),
// 1 <= n_ids <= width (n_ids may be 0 when n_rows is 0); n_rows: the output rows of the sampler's sequence in the
// next decode, in batch order (they must lie in one ubatch), 0 for a sequence outside it (the sampler then builds
// nothing into the graph); coef[3 * n_rows * n_ids] (c0 for every row and id, then c1, then c2), NULL for none
// (greedy only); with temp > 0 also uniform[n_rows]. Returns 0, or -1 (and keeps the previous inputs) for a sampler
// that is not ours, an id out of range, a bad count, missing arrays or a uniform outside [0, 1].
CLOVER_SAMPLER_API int32_t clover_sampler_set_inputs(
        struct llama_sampler * smpl, const int32_t * ids, int32_t n_ids, int32_t n_rows,
        const float * coef, const float * uniform);

// c, the chunk length of a vocabulary of n_vocab ids: the largest divisor of n_vocab up to 1024 (n_vocab itself
// when there is none from 64 up); 0 for n_vocab < 1.
CLOVER_SAMPLER_API int32_t clover_sampler_chunk(int32_t n_vocab);

#ifdef __cplusplus
}
#endif
