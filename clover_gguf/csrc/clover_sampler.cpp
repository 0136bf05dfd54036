// clover_sampler: see clover_sampler.h for what it computes.
//
// How it sits in llama.cpp's sampling graph (the pinned tree's build_sampling, read, not changed): backend_apply is
// called once per output row of the sampler's sequence, with data->logits a 1-D view of that row in a copy of the
// logits tensor padded by one row (t_logits -> ggml_pad). This sampler reads the rows from t_logits itself (the pad's
// source: a read, so the pad copy is never computed for its rows, and it writes nothing into rows llama.cpp may
// still copy out) and computes all of a sequence's rows at once: the first call builds one computation (a "run")
// over the rows from its own to the last one the caller announced, and each later call whose row follows the run's
// previous one gets views of its slot. A row that does not follow (the sequence's rows interleaved with other
// sequences') starts a new run, so the result is right for any row layout and fast for the usual one (a sequence's
// rows consecutive in its ubatch). A layout it does not recognise (no view of a padded 2-D tensor) gets a run of
// its own row. Per-decode inputs (ids, coefficients, uniforms) are the sampler's own state, set with
// clover_sampler_set_inputs, copied into the graph's input tensors by backend_set_input. A sampler set to no rows
// (its sequence outside the next decode) builds nothing: build_sampling would have it build a computation on a
// dummy row that is never computed, and every graph rebuilt beside it (an answer's prompt pass, a verification)
// paid for building and allocating it.

#include "clover_sampler.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

namespace {

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
    ggml_tensor * base  = nullptr; // the 2-D logits tensor the rows are read from (nullptr: a row of its own)
    int64_t       first = 0;       // its first row in base
    int64_t       n     = 0;       // rows (slots) of the run
    int64_t       k0    = 0;       // the caller's row index of slot 0
    int64_t       seen  = 0;       // slots handed out so far
    int64_t       V = 0, c = 0, m = 0;

    ggml_tensor * inp_ids  = nullptr; // [W, n] I32
    ggml_tensor * inp_dead = nullptr; // [m] F32: -inf for a chunk of ids only, else 0 (greedy)
    ggml_tensor * inp_coef = nullptr; // [W, n, 3] F32 (temp > 0)
    ggml_tensor * inp_u    = nullptr; // [1, n] F32 (temp > 0)

    ggml_tensor * out_logits = nullptr; // [W + m, n] F32 (greedy)
    ggml_tensor * out_probs  = nullptr; // [m, n] (greedy, probs) or [W + 1, n] (temp > 0) F32
    ggml_tensor * out_cand   = nullptr; // [W + m, n] or [W + 1, n] I32
    ggml_tensor * out_token  = nullptr; // [1, n] I32 (temp > 0)
};

struct clover_sampler {
    int32_t n_vocab;
    int32_t width;
    bool    probs;
    float   temp;
    int32_t top_k;
    float   top_p;

    // the next decode's inputs (clover_sampler_set_inputs)
    std::vector<int32_t> ids;     // [n_ids]
    int32_t              n_rows = 0;
    std::vector<float>   coef;    // [3][n_rows][n_ids]
    std::vector<float>   uniform; // [n_rows]

    // the current sampling graph
    std::vector<run> runs;
    int64_t          k_next = 0; // the caller's row index of the next backend_apply call

    std::vector<int32_t> buf_i;
    std::vector<float>   buf_f;
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
        r.out_cand   = ggml_cast(ctx, ggml_concat(ctx, cand, ggml_reshape_2d(ctx, tok, 1, n), 0), GGML_TYPE_I32);
        r.out_probs  = s->probs ? ggml_cont(ctx, ggml_reshape_2d(ctx, ggml_get_rows(ctx,
                                       ggml_reshape_3d(ctx, p2, 1, c, m * n), loc), m, n)) : nullptr;
    } else {
        // the corrected row: a copy with the corrected logits written back at the ids
        ggml_tensor * x = ggml_reshape_3d(ctx, ggml_cont(ctx, rows), 1, V, n);
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
        r.out_cand  = ggml_cast(ctx, ggml_concat(ctx, ids_f, ggml_cast(ctx, token, GGML_TYPE_F32), 0), GGML_TYPE_I32);
    }
    for (ggml_tensor * t : { r.out_logits, r.out_probs, r.out_cand, r.out_token }) {
        if (t) {
            mark_output(t);
        }
    }
    return r;
}

// the row view build_sampling gives -> the 2-D tensor to read it from and its row there; false when not recognised
bool locate_row(const ggml_tensor * row, ggml_tensor ** base, int64_t * i_row) {
    ggml_tensor * vs = row->view_src;
    if (vs == nullptr || vs->type != GGML_TYPE_F32 || !ggml_is_contiguous(vs) || vs->ne[0] != row->ne[0] ||
        vs->ne[2] != 1 || vs->ne[3] != 1 || ggml_nelements(row) != row->ne[0] || vs->nb[1] == 0 ||
        row->view_offs % vs->nb[1] != 0) {
        return false;
    }
    const int64_t i = (int64_t) (row->view_offs / vs->nb[1]);
    if (i < 0 || i >= vs->ne[1]) {
        return false;
    }
    *base  = vs;
    *i_row = i;
    // a copy of t_logits with rows appended at the end (ggml_pad(t, 0, 1, 0, 0)): read the row from t_logits
    ggml_tensor * src = vs->src[0];
    const int32_t * pad = vs->op_params; // lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3
    if (vs->op == GGML_OP_PAD && src != nullptr && src->type == GGML_TYPE_F32 && ggml_is_contiguous(src) &&
        src->ne[0] == vs->ne[0] && src->ne[2] == 1 && src->ne[3] == 1 && pad[0] == 0 && pad[1] == 0 && pad[2] == 0 &&
        pad[4] == 0 && pad[5] == 0 && pad[6] == 0 && pad[7] == 0 && i < src->ne[1]) {
        *base = src;
    }
    return true;
}

// ---- llama_sampler_i ----------------------------------------------------------------------------------------------

const char * cs_name(const llama_sampler *) {
    return "clover";
}

// on the host (llama_sampler_sample, when the backend does not take it): greedy over the candidates
void cs_apply(llama_sampler *, llama_token_data_array * cur_p) {
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

llama_sampler * cs_clone(const llama_sampler * smpl) {
    const auto * s = (const clover_sampler *) smpl->ctx;
    return clover_sampler_init(s->n_vocab, s->width, s->probs, s->temp, s->top_k, s->top_p);
}

void cs_free(llama_sampler * smpl) {
    delete self(smpl);
}

void cs_backend_reset(llama_sampler * smpl) {
    self(smpl)->runs.clear();
    self(smpl)->k_next = 0;
}

bool cs_backend_init(llama_sampler * smpl, ggml_backend_buffer_type_t buft, uint32_t /*n_outputs_max_per_seq*/) {
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
        ok = ggml_backend_dev_supports_op(dev, ggml_graph_node(gf, i));
    }
    ggml_free(ctx);
    return ok;
}

void cs_backend_apply(llama_sampler * smpl, ggml_context * ctx, ggml_cgraph *, llama_sampler_data * data) {
    clover_sampler * s = self(smpl);
    ggml_tensor * row = data->logits;
    if (row == nullptr || data->candidates != nullptr || row->type != GGML_TYPE_F32) {
        return; // not the first in its chain (llama.h): leave the data as it is
    }
    if (s->n_rows == 0) {
        return; // no rows announced: a sequence outside the decode (the row stays as llama.cpp computed it)
    }
    const int64_t k = s->k_next++; // the caller's row index of this call

    ggml_tensor * base  = nullptr;
    int64_t       i_row = 0;
    const bool    found = locate_row(row, &base, &i_row);

    run * r = s->runs.empty() ? nullptr : &s->runs.back();
    if (!(found && r != nullptr && r->base == base && r->seen < r->n && i_row == r->first + r->seen &&
          k == r->k0 + r->seen)) {
        run fresh;
        if (found) {
            // from this row to the last the caller announced; past those (a graph built for another decode: the
            // scheduler's reserve) to the end of the tensor
            const int64_t left = base->ne[1] - i_row;
            const int64_t n    = k < s->n_rows ? std::min<int64_t>(s->n_rows - k, left) : left;
            ggml_tensor * rows = ggml_view_2d(ctx, base, base->ne[0], n, base->nb[1], i_row * base->nb[1]);
            fresh = build_run(s, ctx, rows);
        } else {
            fresh = build_run(s, ctx, ggml_reshape_2d(ctx, row, ggml_nelements(row), 1));
        }
        fresh.base  = found ? base : nullptr;
        fresh.first = i_row;
        fresh.k0    = k;
        s->runs.push_back(fresh);
        r = &s->runs.back();
    }
    const int64_t j = r->seen++;

    auto slot = [&](ggml_tensor * t) -> ggml_tensor * {
        return t ? ggml_view_1d(ctx, t, t->ne[0], j * t->nb[1]) : nullptr;
    };
    data->logits     = slot(r->out_logits);
    data->probs      = slot(r->out_probs);
    data->candidates = slot(r->out_cand);
    data->sampled    = slot(r->out_token);
}

void cs_backend_set_input(llama_sampler * smpl) {
    clover_sampler * s = self(smpl);
    const int64_t W     = s->width;
    const int64_t n_ids = (int64_t) s->ids.size();
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
            // a chunk is dead when every one of its c ids is among the W ids: count the distinct ids per chunk from
            // the sorted ids (W entries of host work per decode, nothing the size of the vocabulary)
            std::vector<int32_t> uniq(ids);
            std::sort(uniq.begin(), uniq.end());
            uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
            s->buf_f.assign(r.m, 0.0f);
            for (size_t i = 0; i < uniq.size();) {
                const int64_t ch = uniq[i] / r.c;
                size_t        j  = i;
                while (j < uniq.size() && uniq[j] / r.c == ch) {
                    ++j;
                }
                if ((int64_t) (j - i) == r.c) {
                    s->buf_f[ch] = -INFINITY;
                }
                i = j;
            }
            ggml_backend_tensor_set(r.inp_dead, s->buf_f.data(), 0, ggml_nbytes(r.inp_dead));
        }
        if (r.inp_coef) {
            // the coefficients of the announced rows, padded with the first id's; identity where none were given
            s->buf_f.assign(3 * n * W, 0.0f);
            const bool given = !s->coef.empty();
            for (int q = 0; q < 3; ++q) {
                for (int64_t j = 0; j < n; ++j) {
                    float *       dst = s->buf_f.data() + (q * n + j) * W;
                    const int64_t k   = r.k0 + j;
                    if (given && k < s->n_rows && n_ids > 0) {
                        const float * src = s->coef.data() + (q * s->n_rows + k) * n_ids;
                        for (int64_t w = 0; w < W; ++w) {
                            dst[w] = src[w < n_ids ? w : 0];
                        }
                    } else {
                        std::fill(dst, dst + W, q < 2 ? 1.0f : 0.0f); // unchanged
                    }
                }
            }
            ggml_backend_tensor_set(r.inp_coef, s->buf_f.data(), 0, ggml_nbytes(r.inp_coef));
        }
        if (r.inp_u) {
            s->buf_f.assign(n, 0.5f);
            for (int64_t j = 0; j < n; ++j) {
                if (r.k0 + j < s->n_rows) {
                    s->buf_f[j] = s->uniform[r.k0 + j];
                }
            }
            ggml_backend_tensor_set(r.inp_u, s->buf_f.data(), 0, ggml_nbytes(r.inp_u));
        }
    }
}

void cs_copy_state(const llama_sampler * src, llama_sampler * dst) {
    const auto * a = (const clover_sampler *) src->ctx;
    clover_sampler * b = self(dst);
    b->ids     = a->ids;
    b->n_rows  = a->n_rows;
    b->coef    = a->coef;
    b->uniform = a->uniform;
}

llama_sampler_i clover_sampler_i = {
    /* .name              = */ cs_name,
    /* .accept            = */ nullptr,
    /* .apply             = */ cs_apply,
    /* .reset             = */ nullptr,
    /* .clone             = */ cs_clone,
    /* .free              = */ cs_free,
    /* .backend_init      = */ cs_backend_init,
    /* .backend_accept    = */ nullptr,
    /* .backend_apply     = */ cs_backend_apply,
    /* .backend_set_input = */ cs_backend_set_input,
    /* .backend_reset     = */ cs_backend_reset,
    /* .copy_state        = */ cs_copy_state,
};

} // namespace

extern "C" {

llama_sampler * clover_sampler_init(int32_t n_vocab, int32_t width, bool probs, float temp, int32_t top_k,
                                    float top_p) {
    // ids travel through the graph as float32 (the greedy choice ranks them): exact below 2^24
    if (n_vocab < 1 || n_vocab > (1 << 24) || width < 1 || top_k < 0 || !std::isfinite(temp) ||
        !(top_p > 0.0f && top_p <= 1.0f)) {
        return nullptr;
    }
    auto * s = new (std::nothrow) clover_sampler();
    if (s == nullptr) {
        return nullptr;
    }
    s->n_vocab = n_vocab;
    s->width   = width;
    s->probs   = probs;
    s->temp    = temp;
    s->top_k   = top_k;
    s->top_p   = top_p;
    return llama_sampler_init(&clover_sampler_i, s);
}

int32_t clover_sampler_set_inputs(llama_sampler * smpl, const int32_t * ids, int32_t n_ids, int32_t n_rows,
                                  const float * coef, const float * uniform) {
    if (smpl != nullptr && llama_sampler_chain_get(smpl, -1) != nullptr) { // a chain: its first sampler
        smpl = llama_sampler_chain_n(smpl) > 0 ? llama_sampler_chain_get(smpl, 0) : nullptr;
    }
    if (smpl == nullptr || smpl->iface != &clover_sampler_i) {
        return -1;
    }
    clover_sampler * s = self(smpl);
    if (n_rows < 0 || n_ids < 0 || n_ids > s->width || (n_rows > 0 && n_ids < 1) || (n_ids > 0 && ids == nullptr)) {
        return -1;
    }
    for (int32_t i = 0; i < n_ids; ++i) {
        if (ids[i] < 0 || ids[i] >= s->n_vocab) {
            return -1;
        }
    }
    const bool sampled = s->temp > 0.0f && n_rows > 0;
    if (sampled && (coef == nullptr || uniform == nullptr)) {
        return -1;
    }
    if (sampled) {
        for (int32_t k = 0; k < n_rows; ++k) {
            if (!(uniform[k] >= 0.0f && uniform[k] <= 1.0f)) {
                return -1;
            }
        }
    }
    s->ids.assign(ids, ids + n_ids);
    s->n_rows = n_rows;
    if (coef != nullptr && n_rows > 0) {
        s->coef.assign(coef, coef + (size_t) 3 * n_rows * n_ids);
    } else {
        s->coef.clear();
    }
    if (sampled) {
        s->uniform.assign(uniform, uniform + n_rows);
    } else {
        s->uniform.clear();
    }
    return 0;
}

int32_t clover_sampler_chunk(int32_t n_vocab) {
    return (int32_t) chunk_of(n_vocab);
}

} // extern "C"
