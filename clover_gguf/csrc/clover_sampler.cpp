// clover_sampler: see clover_sampler.h for what it computes.
//
// Its contract with llama.cpp is the public backend sampling interface (include/llama.h, struct llama_sampler_i, with
// the series' llama_sampler_data.row, .refused, .n_rows and .seq_logits): backend_init(buft, n_outputs_max_per_seq)
// once per attach, then for each sampling graph backend_reset, one backend_apply per chain llama.cpp builds for the
// sampler's sequence (data->logits: the row of that chain; data->row: which of the sequence's n_rows output rows in
// the ubatch it is, in batch order, the index into what the caller announced with clover_sampler_set_inputs;
// data->seq_logits: all those rows as one [n_vocab, n_rows] tensor when llama.cpp has them consecutive), and
// backend_set_input before the graph runs. The calls it knows, each a contiguous one-row F32 data->logits with
// nothing set by a sampler before it:
//  - data->row >= 0 with data->seq_logits (a contiguous F32 [n_vocab, n_rows] tensor, row < n_rows): the first call
//    of the graph for that tensor builds one computation (a "run") over all of its rows, in whatever order the calls
//    come; each call gets the slice of its row. One run per sequence, not per row: a 32-row block pass is one
//    top_k / softmax node over 32 rows (split over the CPU's threads, one launch on a GPU), not 32 of one row;
//  - data->row >= 0, no seq_logits and n_rows <= 1: that row, read as given (the tensor llama.cpp passed, nothing
//    around it), a run of its own;
//  - data->row < 0: no output row. A tensor of its own with no op (llama.cpp's node-count probe in backend_init) is a
//    run built as a real row's would be; anything else (a dummy row of a sequence without outputs in the ubatch, a
//    chain llama.cpp does not select) builds nothing and keeps llama.cpp's row.
// Rows at or past the announced count get identity inputs. Anything else (several rows in one call, a strided, non-F32
// or deeper tensor, a row narrowed or sampled by a sampler before it, a row of another length than n_vocab, several
// rows of a sequence without seq_logits: their rows interleaved with another sequence's, where one run per row would
// silently cost a graph node set per row) is refused: data->refused is set (llama_decode then returns -4
// and runs nothing), the data is left as llama.cpp gave it, the reason goes to llama.cpp's log (llama_log_get's
// callback, level error) and stays readable until the next graph (clover_sampler_error). Per-decode inputs (ids,
// coefficients, uniforms, restrictions) are the sampler's own state, set with clover_sampler_set_inputs[_ext], copied
// into the graph's input tensors by backend_set_input.

#include "clover_sampler.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "ggml-alloc.h"

#if defined(_MSC_VER)
#    include <intrin.h>
#endif

namespace {

enum row_mode_t : int32_t { ROW_FREE = 0, ROW_ALLOW = 1, ROW_DENY = 2 };

int popcount32(uint32_t x) {
#if defined(_MSC_VER)
    return (int) __popcnt(x);
#else
    return __builtin_popcount(x);
#endif
}

int lowest_bit(uint32_t x) { // x != 0
#if defined(_MSC_VER)
    unsigned long i;
    _BitScanForward(&i, x);
    return (int) i;
#else
    return __builtin_ctz(x);
#endif
}

int64_t chunk_of(int64_t n_vocab) {
    if (n_vocab < 1) {
        return 0;
    }
    for (int64_t c = std::min<int64_t>(1024, n_vocab); c >= 64; --c) {
        if (n_vocab % c == 0) {
            return c;
        }
    }
    return n_vocab;
}

struct run {
    int64_t       n     = 0;       // rows (slots) of the run
    int64_t       k0    = -1;      // the sampler's row index of slot 0 (llama_sampler_data.row; -1: no row)
    const ggml_tensor * seq = nullptr; // the llama_sampler_data.seq_logits it was built over (nullptr: one row)
    int64_t       V = 0, c = 0, m = 0;

    ggml_tensor * inp_ids  = nullptr; // [W, n] I32
    ggml_tensor * inp_dead = nullptr; // [m] F32: -inf for a chunk of ids only, else 0 (greedy)
    ggml_tensor * inp_coef = nullptr; // [W, n, 3] F32 (temp > 0)
    ggml_tensor * inp_u    = nullptr; // [1, n] F32 (temp > 0)
    ggml_tensor * inp_rest = nullptr; // [1, n] F32: -inf for a row restricted to its allowed ids, else 0
    ggml_tensor * inp_pad  = nullptr; // [W, 1] F32: -inf for the padding slots, else 0 (greedy, top_n)

    ggml_tensor * out_logits = nullptr; // [W + m + 1 + N, n] F32 (greedy), [W + 1 + N, n] (temp > 0, N > 0)
    ggml_tensor * out_probs  = nullptr; // [m, n] (greedy, probs) or [W + 1 + N, n] (temp > 0) F32
    ggml_tensor * out_cand   = nullptr; // [W + m + 1 + N, n] or [W + 1 + N, n] I32
    ggml_tensor * out_token  = nullptr; // [1, n] I32 (temp > 0)
};

struct clover_sampler {
    int32_t n_vocab;
    int32_t width;
    bool    probs;
    float   temp;
    int32_t top_k;
    float   top_p;
    int32_t top_n     = 0;
    bool    save_last = false;

    // the next decode's inputs (clover_sampler_set_inputs_ext)
    std::vector<int32_t> ids;     // [n_ids]
    int32_t              n_rows = 0;
    int32_t              n_coef = 0; // the ids the coefficients are given for (the first n_coef)
    std::vector<float>   coef;    // [3][n_rows][n_coef]
    std::vector<float>   uniform; // [n_rows]
    std::vector<int32_t> row_mode, row_start, row_count, row_cols; // [n_rows] x 3, [n_cols]: the restrictions

    // what backend_init was told: the most output rows of one sequence in a ubatch (0: not attached yet)
    int64_t n_outputs_max_per_seq = 0;

    // the last row kept (save_last): a tensor of its own on the output device, made at the first graph that saves;
    // a clone holds its source's row on the host until it saves one of its own
    ggml_backend_buffer_type_t buft      = nullptr;
    ggml_context *             saved_ctx = nullptr;
    ggml_backend_buffer_t      saved_buf = nullptr;
    ggml_tensor *              saved     = nullptr;
    std::vector<float>         saved_host;

    // the current sampling graph
    std::vector<run> runs;
    std::string      refused;    // why a call of the current graph was refused ("": none)
    // why the sampler cannot select at all ("": it can): backend_init found an op the device cannot run, or llama.cpp
    // asked the host to select (apply); kept for the sampler's life, so that every later decode fails naming it
    std::string      unusable;

    std::vector<int32_t>  buf_i;
    std::vector<float>    buf_f;
    std::vector<uint64_t> seen;     // [ceil(n_vocab / 64)] bits: the distinct ids of a decode (dead chunks)
    std::vector<int32_t>  in_chunk; // [m] distinct ids per chunk
    std::vector<float>    buf_keep;
    std::vector<float>    buf_dead; // [m] the dead chunks of the current inputs (backend_set_input)
    std::vector<int32_t>  col_of;   // [n_vocab] id -> its column while set_inputs_ext runs (else -1)
};

clover_sampler * self(llama_sampler * smpl) {
    return (clover_sampler *) smpl->ctx;
}

void mark_output(ggml_tensor * t) {
    for (; t != nullptr; t = t->view_src) {
        ggml_set_output(t);
    }
}

ggml_tensor * new_input(ggml_context * ctx, ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2, const char * name) {
    ggml_tensor * t = ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

// the computation of n rows [V, n] (contiguous)
run build_run(const clover_sampler * s, ggml_context * ctx, ggml_tensor * rows) {
    run r;
    const int64_t V = rows->ne[0];
    const int64_t n = rows->ne[1];
    const int64_t W = s->width;
    r.n = n;
    r.V = V;
    r.c = chunk_of(V);
    r.m = V / r.c;

    r.inp_ids = new_input(ctx, GGML_TYPE_I32, W, n, 1, "clover_ids");
    r.inp_ids = ggml_reshape_2d(ctx, r.inp_ids, W, n);

    // the logits at the ids, read from the rows as llama.cpp computed them
    ggml_tensor * at = ggml_get_rows(ctx, ggml_reshape_3d(ctx, rows, 1, V, n), r.inp_ids); // [1, W, n]
    ggml_set_name(at, "clover_at_ids");
    ggml_tensor * at2 = ggml_reshape_2d(ctx, at, W, n);
    ggml_tensor * ids_f = ggml_cast(ctx, r.inp_ids, GGML_TYPE_F32); // [W, n]: the ids as candidates

    // each id's logit x, corrected: x * (x > 0 ? c0 : c1) + c2 (the processors' coefficients, per row and id)
    r.inp_coef = new_input(ctx, GGML_TYPE_F32, W, n, 3, "clover_coef");
    auto coef = [&](int q) {
        return ggml_view_2d(ctx, r.inp_coef, W, n, r.inp_coef->nb[1], q * r.inp_coef->nb[2]);
    };
    ggml_tensor * pos   = ggml_step(ctx, at2);
    ggml_tensor * neg   = ggml_scale_bias(ctx, pos, -1.0f, 1.0f);
    ggml_tensor * scale = ggml_add(ctx, ggml_mul(ctx, pos, coef(0)), ggml_mul(ctx, neg, coef(1)));
    ggml_tensor * put   = ggml_add(ctx, ggml_mul(ctx, at2, scale), coef(2)); // [W, n]
    ggml_set_name(put, "clover_at_ids_corrected");

    // a row restricted to its allowed ids: the rest of it excluded (a bias of -inf added to what is read of it)
    r.inp_rest = ggml_reshape_2d(ctx, new_input(ctx, GGML_TYPE_F32, 1, n, 1, "clover_rest_bias"), 1, n);
    const int64_t N = s->top_n;

    if (s->temp <= 0.0f) {
        // the rows stay as llama.cpp computed them: the ids are left out by a mask added to every row (one [c, m]
        // mask for all rows: the ids are the same), and each chunk's largest logit is found, its value read from the
        // row. With probs, the mask goes into the chunks' softmax and the largest logit is found as the largest
        // probability (the softmax is monotonic), whose value is then the output; without, the masked logits are
        // ranked directly (a softmax is an exp per logit: 8 M of them for a 32-row block at V = 248,320)
        const int64_t c = r.c, m = r.m;
        ggml_tensor * ids0 = ggml_view_2d(ctx, r.inp_ids, W, 1, r.inp_ids->nb[1], 0); // the first row's ids
        ggml_tensor * mask = ggml_fill(ctx, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, V, 1), 0.0f);
        mask = ggml_set_rows(ctx, mask, ggml_fill(ctx, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, W, 1), -INFINITY),
                             ggml_cont(ctx, ids0));
        ggml_tensor * x3    = ggml_reshape_3d(ctx, rows, c, m, n);
        ggml_tensor * mask3 = ggml_reshape_3d(ctx, mask, c, m, 1);
        ggml_tensor * p = s->probs ? ggml_soft_max_ext(ctx, x3, mask3, 1.0f, 0.0f) : ggml_add(ctx, x3, mask3);
        ggml_tensor * p2  = ggml_reshape_2d(ctx, p, c, m * n);
        ggml_tensor * loc = ggml_top_k(ctx, p2, 1); // [1, m * n]
        ggml_tensor * val = ggml_get_rows(ctx, ggml_reshape_3d(ctx, rows, 1, c, m * n), loc);
        // a chunk made of ids only: -inf (nothing of it is left to rank; set per decode, r.inp_dead)
        r.inp_dead = ggml_reshape_1d(ctx, new_input(ctx, GGML_TYPE_F32, m, 1, 1, "clover_dead_chunks"), m);
        val = ggml_add(ctx, ggml_reshape_2d(ctx, val, m, n), r.inp_dead);
        val = ggml_add(ctx, val, r.inp_rest);
        ggml_tensor * id_f = ggml_add(ctx, ggml_reshape_2d(ctx, ggml_cast(ctx, loc, GGML_TYPE_F32), m, n),
                                      ggml_arange(ctx, 0.0f, (float) (m * c), (float) c));

        // the choice: the largest of [corrected ids | chunk maxima], the lowest id among equal ones. Ranked by
        // key = (value == max) * (2^24 - id), which has no ties (the ids are distinct; a padded slot repeats its
        // id and value), so the answer does not depend on how a backend's top_k orders equal entries
        ggml_tensor * all  = ggml_concat(ctx, put, val, 0);   // [W + m, n]
        ggml_tensor * cand = ggml_concat(ctx, ids_f, id_f, 0); // [W + m, n] F32: exact below 2^24
        ggml_tensor * all3 = ggml_reshape_3d(ctx, all, 1, W + m, n);
        ggml_tensor * top  = ggml_get_rows(ctx, all3, ggml_top_k(ctx, all, 1));        // [1, 1, n]
        ggml_tensor * mx   = ggml_reshape_2d(ctx, top, 1, n);
        ggml_tensor * tie  = ggml_scale_bias(ctx, ggml_step(ctx, ggml_scale(ctx, ggml_sub(ctx, all, mx), -1.0f)),
                                              -1.0f, 1.0f); // 1 where all >= max
        ggml_tensor * key  = ggml_mul(ctx, tie, ggml_scale_bias(ctx, cand, -1.0f, (float) (1 << 24)));
        ggml_tensor * tok  = ggml_get_rows(ctx, ggml_reshape_3d(ctx, cand, 1, W + m, n), ggml_top_k(ctx, key, 1));
        ggml_set_name(tok, "clover_token");
        r.out_logits = ggml_concat(ctx, all, mx, 0);
        r.out_cand   = ggml_concat(ctx, cand, ggml_reshape_2d(ctx, tok, 1, n), 0);
        if (N > 0) {
            // the row's N most likely: each chunk's N largest of the rest (the ids at -inf), then the N largest of
            // those and the corrected ids (the N largest of a row lie in at most N chunks; a chunk scan is
            // multi-threaded for one row, as above)
            ggml_tensor * xr  = s->probs ? ggml_add(ctx, x3, mask3) : p;                      // [c, m, n]
            ggml_tensor * xr2 = ggml_reshape_2d(ctx, xr, c, m * n);
            ggml_tensor * loc_n = ggml_top_k(ctx, xr2, (int) N);                              // [N, m * n]
            ggml_tensor * v_n = ggml_get_rows(ctx, ggml_reshape_3d(ctx, xr2, 1, c, m * n), loc_n);
            v_n = ggml_add(ctx, ggml_reshape_2d(ctx, v_n, N * m, n), r.inp_rest);
            ggml_tensor * i_n = ggml_add(ctx, ggml_reshape_3d(ctx, ggml_cast(ctx, loc_n, GGML_TYPE_F32), N, m, n),
                                         ggml_reshape_3d(ctx, ggml_arange(ctx, 0.0f, (float) (m * c), (float) c),
                                                         1, m, 1));
            // the padding slots (copies of the first id) left out: the top n are n distinct ids
            r.inp_pad = ggml_reshape_2d(ctx, new_input(ctx, GGML_TYPE_F32, W, 1, 1, "clover_pad"), W, 1);
            ggml_tensor * pool_v = ggml_concat(ctx, ggml_add(ctx, put, r.inp_pad), v_n, 0);    // [W + N m, n]
            ggml_tensor * pool_i = ggml_concat(ctx, ids_f, ggml_reshape_2d(ctx, i_n, N * m, n), 0);
            ggml_tensor * sel    = ggml_top_k(ctx, pool_v, (int) N);                          // [N, n]
            const int64_t np_ = W + N * m;
            ggml_tensor * top_v = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, pool_v, 1, np_, n),
                                                                     sel), N, n);
            ggml_tensor * top_i = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, pool_i, 1, np_, n),
                                                                     sel), N, n);
            r.out_logits = ggml_concat(ctx, r.out_logits, top_v, 0);
            r.out_cand   = ggml_concat(ctx, r.out_cand, top_i, 0);
        }
        r.out_cand = ggml_cast(ctx, r.out_cand, GGML_TYPE_I32);
        r.out_probs  = s->probs ? ggml_cont(ctx, ggml_reshape_2d(ctx, ggml_get_rows(ctx,
                                       ggml_reshape_3d(ctx, p2, 1, c, m * n), loc), m, n)) : nullptr;
    } else {
        // the corrected row: a copy (with the rest bias added) with the corrected logits written back at the ids
        ggml_tensor * x = ggml_reshape_3d(ctx, ggml_add(ctx, rows, r.inp_rest), 1, V, n);
        x = ggml_set_rows(ctx, x, ggml_reshape_3d(ctx, put, 1, W, n), r.inp_ids);
        ggml_tensor * z0 = ggml_reshape_2d(ctx, x, V, n);

        ggml_tensor * probs1 = ggml_soft_max(ctx, z0); // temperature 1: the probabilities reported
        ggml_tensor * z      = ggml_scale(ctx, z0, 1.0f / s->temp);
        ggml_tensor * cand   = nullptr; // the vocabulary id of each column of z (nullptr: the column is the id)
        int64_t nn = V;
        if (s->top_k > 0 && s->top_k < V) {
            nn   = s->top_k;
            cand = ggml_top_k(ctx, z, (int) nn);
            z    = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, z, 1, V, n), cand), nn, n);
        }
        if (s->top_p < 1.0f) {
            ggml_tensor * order = ggml_argsort(ctx, z, GGML_SORT_ORDER_DESC);
            z    = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, z, 1, nn, n), order), nn, n);
            cand = cand ? ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, cand, 1, nn, n), order), nn, n)
                        : order;
            ggml_tensor * pz     = ggml_soft_max(ctx, z);
            ggml_tensor * before = ggml_sub(ctx, ggml_cumsum(ctx, pz), pz);                         // mass ranked above
            ggml_tensor * keep   = ggml_step(ctx, ggml_scale_bias(ctx, before, -1.0f, s->top_p)); // before < top_p
            z = ggml_add(ctx, z, ggml_log(ctx, keep));                                            // -inf where dropped
        }
        ggml_tensor * cdf = ggml_cumsum(ctx, ggml_soft_max(ctx, z)); // [nn, n]

        r.inp_u = ggml_reshape_2d(ctx, new_input(ctx, GGML_TYPE_F32, 1, n, 1, "clover_uniform"), 1, n);
        // the draw: the first entry whose cdf reaches u * (the last cdf entry)
        ggml_tensor * total  = ggml_cont(ctx, ggml_view_2d(ctx, cdf, 1, n, cdf->nb[1], (nn - 1) * cdf->nb[0]));
        ggml_tensor * target = ggml_mul(ctx, r.inp_u, total);
        ggml_tensor * below  = ggml_step(ctx, ggml_scale(ctx, ggml_sub(ctx, cdf, target), -1.0f)); // cdf < target
        ggml_tensor * idx    = ggml_clamp(ctx, ggml_sum_rows(ctx, below), 0.0f, (float) (nn - 1));
        ggml_tensor * token  = ggml_cast(ctx, idx, GGML_TYPE_I32); // [1, n]
        if (cand) {
            token = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, cand, 1, nn, n), token), 1, n);
        }
        ggml_set_name(token, "clover_token");
        ggml_tensor * p3    = ggml_reshape_3d(ctx, probs1, 1, V, n);
        ggml_tensor * at_p  = ggml_reshape_2d(ctx, ggml_get_rows(ctx, p3, r.inp_ids), W, n);
        ggml_tensor * tok_p = ggml_reshape_2d(ctx, ggml_get_rows(ctx, p3, token), 1, n);
        r.out_token = ggml_cont(ctx, token);
        r.out_probs = ggml_concat(ctx, at_p, tok_p, 0);
        r.out_cand  = ggml_concat(ctx, ids_f, ggml_cast(ctx, token, GGML_TYPE_F32), 0);
        if (N > 0) {
            // the N most likely of the corrected row, and the corrected logits at the ids, the draw and those
            ggml_tensor * z3    = ggml_reshape_3d(ctx, z0, 1, V, n);
            ggml_tensor * top   = ggml_top_k(ctx, z0, (int) N); // [N, n]
            ggml_tensor * top_p = ggml_reshape_2d(ctx, ggml_get_rows(ctx, p3, top), N, n);
            ggml_tensor * tok_z = ggml_reshape_2d(ctx, ggml_get_rows(ctx, z3, token), 1, n);
            ggml_tensor * top_z = ggml_reshape_2d(ctx, ggml_get_rows(ctx, z3, top), N, n);
            r.out_probs  = ggml_concat(ctx, r.out_probs, top_p, 0);
            r.out_cand   = ggml_concat(ctx, r.out_cand, ggml_cast(ctx, top, GGML_TYPE_F32), 0);
            r.out_logits = ggml_concat(ctx, ggml_concat(ctx, put, tok_z, 0), top_z, 0);
        }
        r.out_cand = ggml_cast(ctx, r.out_cand, GGML_TYPE_I32);
    }
    for (ggml_tensor * t : { r.out_logits, r.out_probs, r.out_cand, r.out_token }) {
        if (t) {
            mark_output(t);
        }
    }
    return r;
}

std::string shape_of(const ggml_tensor * t) {
    char buf[160];
    snprintf(buf, sizeof(buf), "%s [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "]%s", ggml_type_name(t->type),
             t->ne[0], t->ne[1], t->ne[2], t->ne[3], ggml_is_contiguous(t) ? "" : " (not contiguous)");
    return buf;
}

// "" for a call's row this sampler knows (one contiguous f32 row, read as it is), else why not
std::string check_row(const ggml_tensor * row) {
    if (row->type != GGML_TYPE_F32 || row->ne[1] != 1 || row->ne[2] != 1 || row->ne[3] != 1 ||
        !ggml_is_contiguous(row)) {
        return "its logits are " + shape_of(row) + ", not one contiguous f32 row";
    }
    return "";
}

void log_error(const std::string & line);

// a call this sampler does not know: the data stays as llama.cpp gave it, the call is marked refused (llama_decode
// then fails with -4 and runs nothing), the reason is kept (the first of the graph) and written to llama.cpp's log
void refuse(clover_sampler * s, llama_sampler_data * data, const std::string & why) {
    data->refused = true;
    const std::string line = "clover_sampler: refused row " + std::to_string(data->row) + " of a sampling graph (" +
                             std::to_string(s->n_rows) + " rows announced): " + why + "\n";
    if (s->refused.empty()) {
        s->refused = line.substr(0, line.size() - 1);
    }
    log_error(line);
}

// a line to llama.cpp's log (its callback, level error), else stderr
void log_error(const std::string & line) {
    ggml_log_callback cb = nullptr;
    void *            ud = nullptr;
    llama_log_get(&cb, &ud);
    if (cb != nullptr) {
        cb(GGML_LOG_LEVEL_ERROR, line.c_str(), ud);
    } else {
        fputs(line.c_str(), stderr);
    }
}

// ---- llama_sampler_i ----------------------------------------------------------------------------------------------

const char * cs_name(const llama_sampler *) {
    return "clover";
}

// on the host (llama_sampler_sample, when the backend does not take it): the sampler's outputs (the corrected logits
// at the ids, the chunk maxima, the choice) exist only in the graph, so a host call is an error the caller sees
// (clover_sampler_error), never a silent plain greedy; the candidates' greedy choice is still made so that llama.cpp
// has a token
void cs_apply(llama_sampler * smpl, llama_token_data_array * cur_p) {
    clover_sampler * s = self(smpl);
    if (s->unusable.empty()) {
        s->unusable = "clover_sampler: asked to select on the host (llama.cpp sampled without the sampler's graph: "
                      "backend_init failed or the sampler ran outside a decode's graph); it selects only in the graph";
        log_error(s->unusable + "\n");
    }
    if (cur_p->size == 0) {
        cur_p->selected = -1;
        return;
    }
    size_t best = 0;
    for (size_t i = 1; i < cur_p->size; ++i) {
        if (cur_p->data[i].logit > cur_p->data[best].logit) {
            best = i;
        }
    }
    cur_p->selected = (int64_t) best;
}

void cs_copy_state(const llama_sampler * src, llama_sampler * dst);

// a sampler of the same settings, inputs (ids, coefficients, uniforms, row restrictions), per-sequence row limit and
// kept row; the graph's tensors are the clone's own, built when llama.cpp applies it
llama_sampler * cs_clone(const llama_sampler * smpl) {
    const auto * s = (const clover_sampler *) smpl->ctx;
    llama_sampler * copy = clover_sampler_init_ext(s->n_vocab, s->width, s->probs, s->temp, s->top_k, s->top_p,
                                                   s->top_n, s->save_last);
    if (copy != nullptr) {
        cs_copy_state(smpl, copy);
        self(copy)->n_outputs_max_per_seq = s->n_outputs_max_per_seq;
    }
    return copy;
}

void cs_free(llama_sampler * smpl) {
    clover_sampler * s = self(smpl);
    if (s->saved_buf) {
        ggml_backend_buffer_free(s->saved_buf);
    }
    if (s->saved_ctx) {
        ggml_free(s->saved_ctx);
    }
    delete s;
}

// the tensor the last row is kept in (save_last), made on the output device at the first graph that saves
ggml_tensor * saved_row(clover_sampler * s, int64_t n) {
    if (s->saved == nullptr && s->buft != nullptr) {
        ggml_init_params params = { ggml_tensor_overhead(), nullptr, true };
        s->saved_ctx = ggml_init(params);
        if (s->saved_ctx == nullptr) {
            return nullptr;
        }
        ggml_tensor * t = ggml_new_tensor_1d(s->saved_ctx, GGML_TYPE_F32, n);
        ggml_set_name(t, "clover_saved_row");
        s->saved_buf = ggml_backend_alloc_ctx_tensors_from_buft(s->saved_ctx, s->buft);
        if (s->saved_buf == nullptr) {
            ggml_free(s->saved_ctx);
            s->saved_ctx = nullptr;
            return nullptr;
        }
        s->saved = t;
    }
    return s->saved != nullptr && s->saved->ne[0] == n ? s->saved : nullptr;
}

void cs_backend_reset(llama_sampler * smpl) {
    clover_sampler * s = self(smpl);
    s->runs.clear();
    s->refused.clear();
}

bool cs_backend_init(llama_sampler * smpl, ggml_backend_buffer_type_t buft, uint32_t n_outputs_max_per_seq) {
    // the most rows of one sequence a ubatch holds (llama.cpp fails a decode with more): set_inputs refuses to
    // announce more
    self(smpl)->n_outputs_max_per_seq = std::max<int64_t>(1, n_outputs_max_per_seq);
    self(smpl)->buft = buft;
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (dev == nullptr) {
        return true; // the CPU runs every op
    }
    // every op of a one-row computation over a vocabulary of 128k must run on the device
    const size_t   n_max  = 1024;
    ggml_init_params params = { n_max * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_max, false), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    if (ctx == nullptr) {
        return false;
    }
    ggml_cgraph * gf  = ggml_new_graph_custom(ctx, n_max, false);
    ggml_tensor * row = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 128 * 1024, 1);
    run r = build_run(self(smpl), ctx, row);
    for (ggml_tensor * t : { r.out_logits, r.out_probs, r.out_cand, r.out_token }) {
        if (t) {
            ggml_build_forward_expand(gf, t);
        }
    }
    bool ok = true;
    for (int i = 0; i < ggml_graph_n_nodes(gf) && ok; ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        ok = ggml_backend_dev_supports_op(dev, node);
        if (!ok) {
            // llama.cpp then samples on the host with apply: say why, once, for the caller to see
            self(smpl)->unusable = std::string("clover_sampler: the device ") + ggml_backend_dev_name(dev) +
                                   " cannot run " + ggml_op_desc(node) + " of the sampler's graph";
            log_error(self(smpl)->unusable + "\n");
        }
    }
    ggml_free(ctx);
    return ok;
}

void cs_backend_apply(llama_sampler * smpl, ggml_context * ctx, ggml_cgraph * gf, llama_sampler_data * data) {
    clover_sampler * s = self(smpl);
    ggml_tensor * row = data->logits;
    if (row == nullptr || data->candidates != nullptr || data->probs != nullptr || data->sampled != nullptr) {
        refuse(s, data, "a sampler before it in its chain narrowed or sampled the row (it must come first)");
        return;
    }
    const std::string why = check_row(row);
    if (!why.empty()) {
        refuse(s, data, why);
        return;
    }
    // the row llama.cpp says the call is for; -1: none, the dummy row of a sequence without outputs in the ubatch
    // (its chain is not selected: nothing built) or the node-count probe (a tensor of its own, no op: built as a
    // real row's would be, with identity inputs, so that llama.cpp's node budget holds)
    const int64_t k = data->row;
    if (k < 0 && (row->op != GGML_OP_NONE || row->view_src != nullptr)) {
        return;
    }
    if (k >= 0 && row->ne[0] != s->n_vocab) {
        refuse(s, data, "a row of " + std::to_string(row->ne[0]) + " values, the sampler was made for " +
                            std::to_string(s->n_vocab));
        return;
    }
    ggml_tensor * seq = k >= 0 ? data->seq_logits : nullptr;
    if (k >= 0 && seq == nullptr && data->n_rows > 1) {
        refuse(s, data, "its sequence has " + std::to_string(data->n_rows) + " output rows in the ubatch and no "
                        "seq_logits (they are not consecutive rows of the logits); it computes a sequence's rows as "
                        "one, not one by one");
        return;
    }
    if (seq != nullptr) {
        if (seq->type != GGML_TYPE_F32 || seq->ne[0] != s->n_vocab || seq->ne[1] != data->n_rows || seq->ne[2] != 1 ||
            seq->ne[3] != 1 || !ggml_is_contiguous(seq) || k >= data->n_rows) {
            refuse(s, data, "its sequence's rows are " + shape_of(seq) + ", not " + std::to_string(data->n_rows) +
                            " contiguous f32 rows of " + std::to_string(s->n_vocab) + " holding row " +
                            std::to_string(k));
            return;
        }
    }
    // the run the call's row is a slot of: the sequence's (built by its first call in the graph), else its own
    int64_t slot = 0;
    const run * r = nullptr;
    if (seq != nullptr) {
        for (const run & q : s->runs) {
            if (q.seq == seq) {
                r = &q;
            }
        }
        slot = k;
    }
    if (r == nullptr) {
        run q = build_run(s, ctx, seq != nullptr ? seq : ggml_reshape_2d(ctx, row, row->ne[0], 1));
        q.k0  = seq != nullptr ? 0 : k;
        q.seq = seq;
        s->runs.push_back(q);
        r = &s->runs.back();
    }

    if (k >= 0 && s->save_last && k == s->n_rows - 1) {
        // the last announced row, raw, into the sampler's own tensor (read later: clover_sampler_saved_logit); from
        // the sequence's rows when given (llama.cpp's padded copy is then not computed for this)
        ggml_tensor * dst = saved_row(s, row->ne[0]);
        if (dst != nullptr) {
            ggml_tensor * src = seq != nullptr ? ggml_view_1d(ctx, seq, seq->ne[0], k * seq->nb[1]) : row;
            ggml_build_forward_expand(gf, ggml_cpy(ctx, src, dst));
        }
    }

    auto out = [&](ggml_tensor * t) -> ggml_tensor * {
        return t ? ggml_view_1d(ctx, t, t->ne[0], slot * t->nb[1]) : nullptr;
    };
    data->logits     = out(r->out_logits);
    data->probs      = out(r->out_probs);
    data->candidates = out(r->out_cand);
    data->sampled    = out(r->out_token);
}

void cs_backend_set_input(llama_sampler * smpl) {
    clover_sampler * s = self(smpl);
    const int64_t W      = s->width;
    const int64_t n_ids  = (int64_t) s->ids.size();
    const int64_t n_coef = s->coef.empty() ? 0 : s->n_coef;
    const bool    limits = !s->row_mode.empty();
    int64_t dead_V = -1; // the vocabulary buf_dead was counted for
    for (const run & r : s->runs) {
        const int64_t n = r.n;
        // the ids, padded with the first; an id the graph's vocabulary does not hold reads token 0
        std::vector<int32_t> ids(W, 0);
        for (int64_t w = 0; w < W; ++w) {
            const int32_t id = n_ids > 0 ? s->ids[w < n_ids ? w : 0] : 0;
            ids[w] = id >= 0 && id < r.V ? id : 0;
        }
        s->buf_i.resize(n * W);
        for (int64_t j = 0; j < n; ++j) {
            std::memcpy(s->buf_i.data() + j * W, ids.data(), W * sizeof(int32_t));
        }
        ggml_backend_tensor_set(r.inp_ids, s->buf_i.data(), 0, ggml_nbytes(r.inp_ids));

        if (r.inp_dead) {
            // a chunk is dead when every one of its c ids is among the W ids: the distinct ids counted per chunk
            // through a bit per id (O(W) host work per decode, nothing the size of the vocabulary touched); the
            // same for every run of a vocabulary (a run per sequence or lone row), so counted once
            if (dead_V != r.V) {
                dead_V = r.V;
                s->seen.resize((r.V + 63) / 64);
                s->in_chunk.assign(r.m, 0);
                s->buf_dead.assign(r.m, 0.0f);
                for (const int32_t id : ids) {
                    uint64_t & word = s->seen[id >> 6];
                    const uint64_t bit = uint64_t(1) << (id & 63);
                    if (!(word & bit)) {
                        word |= bit;
                        if (++s->in_chunk[id / r.c] == r.c) {
                            s->buf_dead[id / r.c] = -INFINITY;
                        }
                    }
                }
                for (const int32_t id : ids) {
                    s->seen[id >> 6] = 0;
                }
            }
            ggml_backend_tensor_set(r.inp_dead, s->buf_dead.data(), 0, ggml_nbytes(r.inp_dead));
        }
        if (r.inp_coef) {
            // the coefficients of the announced rows (identity where none were given), the rows' restrictions on
            // c2, then the padding slots as the first id's
            s->buf_f.resize(3 * n * W);
            for (int q = 0; q < 3; ++q) {
                const float unit = q < 2 ? 1.0f : 0.0f;
                for (int64_t j = 0; j < n; ++j) {
                    float *       dst = s->buf_f.data() + (q * n + j) * W;
                    const int64_t k   = r.k0 + j;
                    const bool    in  = k >= 0 && k < s->n_rows && n_ids > 0;
                    int64_t       w0  = 0;
                    if (in && n_coef > 0) {
                        std::memcpy(dst, s->coef.data() + (q * s->n_rows + k) * n_coef, n_coef * sizeof(float));
                        w0 = n_coef;
                    }
                    std::fill(dst + w0, dst + std::max<int64_t>(n_ids, 1), unit);
                    if (q == 2 && in && limits && s->row_mode[k] != ROW_FREE) {
                        const int32_t * cols = s->row_cols.data() + s->row_start[k];
                        const int32_t   nc   = s->row_count[k];
                        if (s->row_mode[k] == ROW_DENY) {
                            for (int32_t i = 0; i < nc; ++i) {
                                dst[cols[i]] = -INFINITY;
                            }
                        } else { // allow: every other id excluded (the rest of the row too: inp_rest)
                            std::vector<float> & keep = s->buf_keep;
                            keep.resize(nc);
                            for (int32_t i = 0; i < nc; ++i) {
                                keep[i] = dst[cols[i]];
                            }
                            std::fill(dst, dst + n_ids, -INFINITY);
                            for (int32_t i = 0; i < nc; ++i) {
                                dst[cols[i]] = keep[i];
                            }
                        }
                    }
                    std::fill(dst + std::max<int64_t>(n_ids, 1), dst + W, dst[0]);
                }
            }
            ggml_backend_tensor_set(r.inp_coef, s->buf_f.data(), 0, ggml_nbytes(r.inp_coef));
        }
        if (r.inp_pad) {
            s->buf_f.assign(W, 0.0f);
            std::fill(s->buf_f.begin() + std::max<int64_t>(n_ids, 1), s->buf_f.end(), -INFINITY);
            ggml_backend_tensor_set(r.inp_pad, s->buf_f.data(), 0, ggml_nbytes(r.inp_pad));
        }
        if (r.inp_rest) {
            s->buf_f.assign(n, 0.0f);
            for (int64_t j = 0; j < n; ++j) {
                const int64_t k = r.k0 + j;
                if (limits && k >= 0 && k < s->n_rows && s->row_mode[k] == ROW_ALLOW) {
                    s->buf_f[j] = -INFINITY;
                }
            }
            ggml_backend_tensor_set(r.inp_rest, s->buf_f.data(), 0, ggml_nbytes(r.inp_rest));
        }
        if (r.inp_u) {
            s->buf_f.assign(n, 0.5f);
            for (int64_t j = 0; j < n; ++j) {
                if (r.k0 >= 0 && r.k0 + j < s->n_rows) {
                    s->buf_f[j] = s->uniform[r.k0 + j];
                }
            }
            ggml_backend_tensor_set(r.inp_u, s->buf_f.data(), 0, ggml_nbytes(r.inp_u));
        }
    }
}

// the state that is not the current graph's: the inputs and the kept row (upstream's copy_state contract)
void cs_copy_state(const llama_sampler * src, llama_sampler * dst) {
    const auto * a = (const clover_sampler *) src->ctx;
    clover_sampler * b = self(dst);
    b->ids       = a->ids;
    b->n_rows    = a->n_rows;
    b->n_coef    = a->n_coef;
    b->coef      = a->coef;
    b->uniform   = a->uniform;
    b->row_mode  = a->row_mode;
    b->row_start = a->row_start;
    b->row_count = a->row_count;
    b->row_cols  = a->row_cols;
    b->saved_host = a->saved_host;
    if (a->saved != nullptr) {
        b->saved_host.resize(a->saved->ne[0]);
        ggml_backend_tensor_get(a->saved, b->saved_host.data(), 0, ggml_nbytes(a->saved));
    }
}

// filled by member name: the order of llama_sampler_i is llama.h's business
llama_sampler_i make_interface() {
    llama_sampler_i i{};
    i.name              = cs_name;
    i.accept            = nullptr;
    i.apply             = cs_apply;
    i.reset             = nullptr;
    i.clone             = cs_clone;
    i.free              = cs_free;
    i.backend_init      = cs_backend_init;
    i.backend_accept    = nullptr;
    i.backend_apply     = cs_backend_apply;
    i.backend_set_input = cs_backend_set_input;
    i.backend_reset     = cs_backend_reset;
    i.copy_state        = cs_copy_state;
    return i;
}

llama_sampler_i clover_sampler_i = make_interface();

} // namespace

extern "C" {

llama_sampler * clover_sampler_init_ext(int32_t n_vocab, int32_t width, bool probs, float temp, int32_t top_k,
                                        float top_p, int32_t top_n, bool save_last) {
    // ids travel through the graph as float32 (the greedy choice ranks them): exact below 2^24
    if (n_vocab < 1 || n_vocab > (1 << 24) || width < 1 || top_k < 0 || !std::isfinite(temp) ||
        !(top_p > 0.0f && top_p <= 1.0f) || top_n < 0 || top_n > CLOVER_SAMPLER_MAX_TOP_N) {
        return nullptr;
    }
    // what a row returns must fit llama.cpp's output row of n_vocab values (it aborts the process otherwise)
    const int64_t c = chunk_of(n_vocab), m = n_vocab / c;
    const int64_t per_row = temp > 0.0f ? (int64_t) width + 1 + top_n : (int64_t) width + m + 1 + top_n;
    if (per_row > n_vocab || (temp <= 0.0f && top_n > c)) {
        return nullptr;
    }
    auto * s = new (std::nothrow) clover_sampler();
    if (s == nullptr) {
        return nullptr;
    }
    s->n_vocab   = n_vocab;
    s->width     = width;
    s->probs     = probs;
    s->temp      = temp;
    s->top_k     = top_k;
    s->top_p     = top_p;
    s->top_n     = top_n;
    s->save_last = save_last;
    return llama_sampler_init(&clover_sampler_i, s);
}

llama_sampler * clover_sampler_init(int32_t n_vocab, int32_t width, bool probs, float temp, int32_t top_k,
                                    float top_p) {
    return clover_sampler_init_ext(n_vocab, width, probs, temp, top_k, top_p, 0, false);
}

// the sampler, or the first of a chain's samplers that is ours (not first in its chain, it refuses its calls at graph
// time, saying why: clover_sampler_error)
static clover_sampler * ours(llama_sampler * smpl) {
    if (smpl != nullptr && llama_sampler_chain_get(smpl, -1) != nullptr) { // a chain
        for (int32_t i = 0; i < llama_sampler_chain_n(smpl); ++i) {
            llama_sampler * s = llama_sampler_chain_get(smpl, i);
            if (s != nullptr && s->iface == &clover_sampler_i) {
                return self(s);
            }
        }
        return nullptr;
    }
    return smpl != nullptr && smpl->iface == &clover_sampler_i ? self(smpl) : nullptr;
}

int32_t clover_sampler_set_inputs_ext(llama_sampler * smpl, const int32_t * ids, int32_t n_ids, int32_t n_rows,
                                      const float * coef, int32_t n_coef, const float * uniform,
                                      const int32_t * masks, int32_t n_words, int32_t n_masks,
                                      const int32_t * row_mask) {
    clover_sampler * s = ours(smpl);
    if (s == nullptr) {
        return -1;
    }
    if (n_rows < 0 || n_ids < 0 || n_ids > s->width || (n_rows > 0 && n_ids < 1) || (n_ids > 0 && ids == nullptr)) {
        return -1;
    }
    if (s->n_outputs_max_per_seq > 0 && n_rows > s->n_outputs_max_per_seq) {
        return -1; // more rows than a ubatch may hold of one sequence (the context's n_outputs_max_per_seq)
    }
    for (int32_t i = 0; i < n_ids; ++i) {
        if (ids[i] < 0 || ids[i] >= s->n_vocab) {
            return -1;
        }
    }
    if (coef == nullptr) {
        n_coef = 0;
    } else if (n_coef < 0 || n_coef > n_ids) {
        return -1;
    }
    const bool sampled = s->temp > 0.0f && n_rows > 0;
    if (sampled) {
        if (uniform == nullptr) {
            return -1;
        }
        for (int32_t k = 0; k < n_rows; ++k) {
            if (!(uniform[k] >= 0.0f && uniform[k] <= 1.0f)) {
                return -1;
            }
        }
    }
    const bool limits = row_mask != nullptr && n_rows > 0;
    std::vector<int32_t> all(ids, ids + n_ids);
    std::vector<int32_t> mode, start, count, cols;
    if (limits) {
        if (masks == nullptr || n_words < 1 || n_masks < 1) {
            return -1;
        }
        for (int32_t k = 0; k < n_rows; ++k) {
            if (row_mask[k] < -1 || row_mask[k] >= n_masks) {
                return -1;
            }
        }
        // each mask a row uses -> its ids (the allowed, or the excluded when fewer), found by scanning its words;
        // their columns through a map from id to column (set for this call's ids only, then cleared)
        std::vector<int32_t> & col_of = s->col_of;
        col_of.resize(s->n_vocab, -1);
        for (int32_t i = 0; i < n_ids; ++i) {
            if (col_of[ids[i]] < 0) {
                col_of[ids[i]] = i;
            }
        }
        std::vector<int32_t> m_mode(n_masks, ROW_FREE), m_start(n_masks, 0), m_count(n_masks, 0);
        const int64_t V = s->n_vocab;
        const int64_t words = std::min<int64_t>(n_words, (V + 31) / 32);
        bool ok = true;
        for (int32_t k = 0; k < n_rows && ok; ++k) {
            const int32_t j = row_mask[k];
            if (j < 0 || m_mode[j] != ROW_FREE) {
                continue;
            }
            const uint32_t * w = (const uint32_t *) masks + (size_t) j * n_words;
            auto word = [&](int64_t i) -> uint32_t { // the allowed bits of word i within the vocabulary
                uint32_t x = i < words ? w[i] : 0u;
                if (i == (V - 1) / 32 && V % 32) {
                    x &= (uint32_t(1) << (V % 32)) - 1;
                }
                return x;
            };
            int64_t n_allowed = 0;
            for (int64_t i = 0; i < words; ++i) {
                n_allowed += popcount32(word(i));
            }
            if (n_allowed == 0) {
                ok = false;
                break;
            }
            const bool allow = n_allowed <= V - n_allowed;
            m_mode[j]  = allow ? ROW_ALLOW : ROW_DENY;
            m_start[j] = (int32_t) cols.size();
            for (int64_t i = 0; i < (V + 31) / 32; ++i) {
                uint32_t x = word(i);
                if (!allow) {
                    x = ~x;
                    if (i == (V - 1) / 32 && V % 32) {
                        x &= (uint32_t(1) << (V % 32)) - 1;
                    }
                }
                while (x) {
                    const int32_t id = (int32_t) (i * 32 + lowest_bit(x));
                    x &= x - 1;
                    if (col_of[id] < 0) {
                        col_of[id] = (int32_t) all.size();
                        all.push_back(id);
                    }
                    cols.push_back(col_of[id]);
                }
            }
            m_count[j] = (int32_t) cols.size() - m_start[j];
            ok = (int64_t) all.size() <= s->width;
        }
        for (const int32_t id : all) {
            col_of[id] = -1;
        }
        if (!ok) {
            return -1;
        }
        mode.resize(n_rows);
        start.resize(n_rows);
        count.resize(n_rows);
        for (int32_t k = 0; k < n_rows; ++k) {
            const int32_t j = row_mask[k];
            mode[k]  = j < 0 ? ROW_FREE : m_mode[j];
            start[k] = j < 0 ? 0 : m_start[j];
            count[k] = j < 0 ? 0 : m_count[j];
        }
    }
    s->ids = std::move(all);
    s->n_rows = n_rows;
    s->n_coef = n_coef;
    if (coef != nullptr && n_rows > 0 && n_coef > 0) {
        s->coef.assign(coef, coef + (size_t) 3 * n_rows * n_coef);
    } else {
        s->coef.clear();
    }
    if (sampled) {
        s->uniform.assign(uniform, uniform + n_rows);
    } else {
        s->uniform.clear();
    }
    s->row_mode  = std::move(mode);
    s->row_start = std::move(start);
    s->row_count = std::move(count);
    s->row_cols  = std::move(cols);
    return (int32_t) s->ids.size();
}

int32_t clover_sampler_set_inputs(llama_sampler * smpl, const int32_t * ids, int32_t n_ids, int32_t n_rows,
                                  const float * coef, const float * uniform) {
    clover_sampler * s = ours(smpl);
    if (s != nullptr && s->temp > 0.0f && n_rows > 0 && coef == nullptr) {
        return -1; // this entry point's rule: with temperature, the coefficients are given
    }
    return clover_sampler_set_inputs_ext(smpl, ids, n_ids, n_rows, coef, n_ids, uniform, nullptr, 0, 0, nullptr) < 0
               ? -1 : 0;
}

int32_t clover_sampler_saved_logit(llama_sampler * smpl, int32_t token, float * out) {
    clover_sampler * s = ours(smpl);
    if (s == nullptr || out == nullptr || token < 0) {
        return -1;
    }
    if (s->saved != nullptr) {
        if (token >= s->saved->ne[0]) {
            return -1;
        }
        ggml_backend_tensor_get(s->saved, out, (size_t) token * sizeof(float), sizeof(float));
        return 0;
    }
    if (token >= (int64_t) s->saved_host.size()) {
        return -1; // nothing kept (also a clone of a sampler that kept nothing)
    }
    *out = s->saved_host[token];
    return 0;
}

const char * clover_sampler_error(llama_sampler * smpl) {
    const clover_sampler * s = ours(smpl);
    if (s == nullptr) {
        return "not a clover sampler";
    }
    return !s->unusable.empty() ? s->unusable.c_str() : s->refused.empty() ? nullptr : s->refused.c_str();
}

int32_t clover_sampler_chunk(int32_t n_vocab) {
    return (int32_t) chunk_of(n_vocab);
}

} // extern "C"
