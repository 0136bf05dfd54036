// clover-sampler-test: the sampler's contract with llama.cpp's backend sampling interface (clover_sampler.cpp's
// header), driven through that interface alone (struct llama_sampler_i by member, ggml tensors) on the CPU backend.
// Built beside the library (CMakeLists.txt); tests/test_sampler_lib.py runs it. Exit status 0 when every check holds;
// each failed check prints one line "FAILED: ...".
//  - calls it does not know are refused: the call is marked refused (llama_sampler_data.refused: llama_decode fails),
//    the data is left as llama.cpp gave it, the reason is written to llama.cpp's log and kept (clover_sampler_error)
//    until the next graph: several rows in one call, a 3-D tensor, an I32 row, a row of another length, a row a sampler
//    before it narrowed;
//    a sequence's several rows without seq_logits (interleaved with another's), seq_logits of another shape;
//  - calls it knows: a sequence's rows (data.seq_logits, n_rows) are one computation over all of them whatever the
//    order of the calls, read from seq_logits (llama.cpp's padded copy not computed), a 32-row graph about as many
//    nodes as a one-row graph; a lone row without seq_logits is a computation of its own on the tensor passed (a row of
//    ggml_pad's copy is read from the copy); a call for no row (data.row -1) on llama.cpp's rows adds nothing, one on
//    a tensor of its own (llama.cpp's probe) is computed; at most n_outputs_max_per_seq rows may be announced;
//  - outputs: each row's greedy choice is its argmax; coefficients that decide and a bitmask row restricting it change
//    it as they should, each row getting the inputs and the slice of its data.row whatever the order of the calls;
//    a clone (settings, inputs, restrictions, the per-sequence row limit) computes the same.
#include "clover_sampler.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

int n_failed = 0;

void check(bool ok, const std::string & what) {
    if (!ok) {
        fprintf(stderr, "FAILED: %s\n", what.c_str());
        n_failed++;
    }
}

const int64_t V     = 3000; // a vocabulary of 3 chunks of 1000
const int32_t WIDTH = 4;

std::string log_text; // what the sampler wrote to llama.cpp's log

void on_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_CONT) {
        log_text += text;
    }
}

struct graph_ctx {
    ggml_context * ctx = nullptr;
    ggml_cgraph *  gf  = nullptr;

    graph_ctx() {
        ggml_init_params params = { 8192 * ggml_tensor_overhead() + ggml_graph_overhead_custom(8192, false), nullptr,
                                    true };
        ctx = ggml_init(params);
        gf  = ggml_new_graph_custom(ctx, 8192, false);
    }
    ~graph_ctx() { ggml_free(ctx); }
    graph_ctx(const graph_ctx &)             = delete;
    graph_ctx & operator=(const graph_ctx &) = delete;
};

// one call as build_sampling makes it: `row` the index of the sequence's output row (-1: none) among its n_rows,
// `seq` all of them when consecutive
llama_sampler_data apply(llama_sampler * smpl, graph_ctx & g, ggml_tensor * logits, int32_t row = 0,
                         int32_t n_rows = 1, ggml_tensor * seq = nullptr) {
    llama_sampler_data data = { logits, nullptr, nullptr, nullptr, row, false, row < 0 ? 0 : n_rows, seq };
    smpl->iface->backend_apply(smpl, g.ctx, g.gf, &data);
    return data;
}

// refused: marked so, the data as it was, the reason kept and in the log
bool refused(llama_sampler * smpl, const llama_sampler_data & data, ggml_tensor * logits) {
    return data.refused && data.logits == logits && data.candidates == nullptr && data.sampled == nullptr && data.probs == nullptr &&
           clover_sampler_error(smpl) != nullptr && log_text.find("clover_sampler: refused") != std::string::npos;
}

bool in_graph(ggml_cgraph * gf, ggml_op op) {
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        if (ggml_graph_node(gf, i)->op == op) {
            return true;
        }
    }
    return false;
}

// the distinct computations (runs) a set of outputs are views of
size_t n_runs(const std::vector<llama_sampler_data> & outs) {
    std::set<const ggml_tensor *> runs;
    for (const auto & d : outs) {
        runs.insert(d.candidates ? d.candidates->view_src : nullptr);
    }
    return runs.size();
}

llama_sampler * make(ggml_backend_buffer_type_t buft, uint32_t n_outputs_max_per_seq) {
    llama_sampler * smpl = clover_sampler_init((int32_t) V, WIDTH, false, 0.0f, 0, 1.0f);
    if (smpl == nullptr || !smpl->iface->backend_init(smpl, buft, n_outputs_max_per_seq)) {
        fprintf(stderr, "FAILED: clover_sampler_init / backend_init\n");
        exit(1);
    }
    return smpl;
}

void announce(llama_sampler * smpl, int32_t n_rows) {
    const int32_t ids[WIDTH] = { 5, 17, 2500, 999 };
    if (clover_sampler_set_inputs(smpl, ids, n_rows > 0 ? WIDTH : 0, n_rows, nullptr, nullptr) != 0) {
        fprintf(stderr, "FAILED: set_inputs of %d rows\n", n_rows);
        exit(1);
    }
}

// the greedy tokens of a sequence whose output rows are the rows `rows` of values ([V, n]; default: 0..n-1),
// computed by the graph `smpl` builds on them as build_sampling passes them: a row of ggml_pad's copy per call, the
// rows as one view of values when consecutive (seq_logits), the i-th call for the sequence's row idx[i] (default: i;
// the tokens come back in call order)
std::vector<int32_t> greedy(llama_sampler * smpl, ggml_backend_t backend, const std::vector<float> & values,
                            int64_t n, std::vector<int64_t> rows_of_seq = {}, std::vector<int32_t> idx = {}) {
    if (rows_of_seq.empty()) {
        for (int64_t i = 0; i < n; ++i) {
            rows_of_seq.push_back(i);
        }
    }
    for (size_t i = idx.size(); i < rows_of_seq.size(); ++i) {
        idx.push_back((int32_t) i);
    }
    const int32_t n_rows = (int32_t) rows_of_seq.size();
    graph_ctx g;
    ggml_tensor * rows = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, V, n);
    ggml_set_input(rows);
    ggml_tensor * padded = ggml_pad(g.ctx, rows, 0, 1, 0, 0);
    ggml_tensor * seq    = rows_of_seq.back() - rows_of_seq.front() + 1 == n_rows
                               ? ggml_view_2d(g.ctx, rows, V, n_rows, rows->nb[1], rows_of_seq.front() * rows->nb[1])
                               : nullptr;
    smpl->iface->backend_reset(smpl);
    std::vector<ggml_tensor *> cand(idx.size());
    for (size_t i = 0; i < idx.size(); ++i) {
        cand[i] = apply(smpl, g, ggml_view_1d(g.ctx, padded, V, rows_of_seq[idx[i]] * padded->nb[1]), idx[i], n_rows,
                        seq).candidates;
        if (cand[i] == nullptr) {
            return {};
        }
        ggml_build_forward_expand(g.gf, cand[i]);
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(g.ctx, backend);
    ggml_backend_tensor_set(rows, values.data(), 0, ggml_nbytes(rows));
    smpl->iface->backend_set_input(smpl);
    ggml_backend_graph_compute(backend, g.gf);
    std::vector<int32_t> out(idx.size());
    for (size_t i = 0; i < idx.size(); ++i) {
        std::vector<int32_t> c(cand[i]->ne[0]);
        ggml_backend_tensor_get(cand[i], c.data(), 0, ggml_nbytes(cand[i]));
        out[i] = c.back(); // the last candidate: the choice (clover_sampler.h)
    }
    ggml_backend_buffer_free(buf);
    return out;
}

} // namespace

int main() {
    llama_log_set(on_log, nullptr);
    ggml_backend_t backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (backend == nullptr) {
        fprintf(stderr, "FAILED: no CPU backend\n");
        return 1;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backend);

    // ---- the interface, filled by member
    {
        llama_sampler * smpl = make(buft, 4);
        const llama_sampler_i * i = smpl->iface;
        check(i->name != nullptr && strcmp(i->name(smpl), "clover") == 0, "iface.name is the sampler's name");
        check(i->apply != nullptr && i->clone != nullptr && i->free != nullptr && i->accept == nullptr &&
                  i->reset == nullptr, "iface's host members");
        check(i->backend_init != nullptr && i->backend_apply != nullptr && i->backend_set_input != nullptr &&
                  i->backend_reset != nullptr && i->copy_state != nullptr && i->backend_accept == nullptr,
              "iface's backend members");
        llama_sampler_free(smpl);
    }

    // ---- asked to select on the host (what llama.cpp does when backend_init fails): an error the caller sees, for the
    // sampler's life, never a silent plain greedy
    {
        llama_sampler * smpl = make(buft, 4);
        announce(smpl, 1);
        check(clover_sampler_error(smpl) == nullptr, "a new sampler has no error");
        std::vector<llama_token_data> cand = { { 3, 1.0f, 0.0f }, { 7, 2.0f, 0.0f } };
        llama_token_data_array cur_p = { cand.data(), cand.size(), -1, false };
        log_text.clear();
        llama_sampler_apply(smpl, &cur_p);
        const char * why = clover_sampler_error(smpl);
        check(why != nullptr && strstr(why, "on the host") != nullptr, "a host selection is an error it reports");
        check(log_text.find("on the host") != std::string::npos, "the host selection is in llama.cpp's log");
        smpl->iface->backend_reset(smpl);
        check(clover_sampler_error(smpl) != nullptr, "a new graph does not clear it");
        llama_sampler_free(smpl);
    }

    // ---- calls it does not know: refused, nothing computed
    {
        llama_sampler * smpl = make(buft, 4);
        announce(smpl, 2);
        graph_ctx g;
        smpl->iface->backend_reset(smpl);
        log_text.clear();
        ggml_tensor * two = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, V, 2);
        const int n_nodes = ggml_graph_n_nodes(g.gf);
        check(refused(smpl, apply(smpl, g, two), two), "two rows in one call are refused, the data left as it was");
        check(ggml_graph_n_nodes(g.gf) == n_nodes, "a refused call adds nothing to the graph");
        const char * why = clover_sampler_error(smpl);
        check(why != nullptr && strstr(why, "f32 [3000, 2, 1, 1]") != nullptr, "the reason names the call's shape");
        check(log_text.find("f32 [3000, 2, 1, 1]") != std::string::npos, "the reason is in llama.cpp's log");
        smpl->iface->backend_reset(smpl);
        check(clover_sampler_error(smpl) == nullptr, "the next graph clears the refusal");

        struct bad {
            ggml_tensor * t;
            const char *  what;
        };
        ggml_tensor * deep = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, V, 2, 2);
        ggml_tensor * rows = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, V - 1, 3);
        const bad cases[] = {
            { ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, V, 1, 2), "a 3-D tensor" },
            { ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, V), "an I32 row" },
            { ggml_view_1d(g.ctx, rows, V - 1, rows->nb[1]), "a row of another length" },
        };
        for (const bad & b : cases) {
            smpl->iface->backend_reset(smpl);
            log_text.clear();
            check(refused(smpl, apply(smpl, g, b.t), b.t), std::string(b.what) + " is refused");
        }
        // a row is read as passed, whatever tensor it is a view of
        smpl->iface->backend_reset(smpl);
        llama_sampler_data in3d = apply(smpl, g, ggml_view_1d(g.ctx, deep, V, deep->nb[2]));
        check(!in3d.refused && in3d.candidates != nullptr && clover_sampler_error(smpl) == nullptr,
              "a contiguous row viewed in a 3-D tensor is read as passed");
        smpl->iface->backend_reset(smpl);
        log_text.clear();
        ggml_tensor *      row   = ggml_view_1d(g.ctx, ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, V, 2), V, 0);
        ggml_tensor *      nar   = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, 5);
        llama_sampler_data after = { row, nullptr, nullptr, nar, 0, false, 1, nullptr };
        smpl->iface->backend_apply(smpl, g.ctx, g.gf, &after);
        check(after.refused && after.logits == row && after.candidates == nar && clover_sampler_error(smpl) != nullptr,
              "a row a sampler before it narrowed is refused");
        llama_sampler_free(smpl);
    }

    // ---- calls it knows
    {
        llama_sampler * smpl = make(buft, 4);
        const int32_t one[1] = { 5 };
        check(clover_sampler_set_inputs(smpl, one, 1, 5, nullptr, nullptr) == -1,
              "more rows than n_outputs_max_per_seq cannot be announced");
        announce(smpl, 3);
        graph_ctx g;
        ggml_tensor * rows = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, V, 4);
        auto row = [&](int64_t i) { return ggml_view_1d(g.ctx, rows, V, i * rows->nb[1]); };
        smpl->iface->backend_reset(smpl);
        ggml_tensor * seq3 = ggml_view_2d(g.ctx, rows, V, 3, rows->nb[1], 0);
        std::vector<llama_sampler_data> out;
        for (int64_t i : { 2, 0, 1 }) {
            out.push_back(apply(smpl, g, row(i), (int32_t) i, 3, seq3));
        }
        check(clover_sampler_error(smpl) == nullptr && out[0].candidates && out[1].candidates && out[2].candidates &&
                  !out[0].refused && !out[1].refused && !out[2].refused,
              "a sequence's rows with seq_logits are known calls, in any order");
        check(n_runs(out) == 1 && out[0].candidates->view_src->ne[1] == 3,
              "a sequence's rows are one computation over seq_logits, whichever row's call comes first");
        check(out[0].candidates && out[1].candidates && out[0].candidates->view_offs == 2 * out[0].candidates->nb[1] &&
                  out[1].candidates->view_offs == 0,
              "each call gets the slice of its data.row");
        {
            // a lone row (n_rows 1, no seq_logits): a computation of its own on the tensor passed
            llama_sampler_data lone = apply(smpl, g, row(3), 0, 1, nullptr);
            check(!lone.refused && lone.candidates && lone.candidates->view_src->ne[1] == 1,
                  "a lone row without seq_logits is a computation of its own");
        }
        {
            // several rows of a sequence without seq_logits (interleaved with another's), or seq_logits of another
            // shape: refused, naming why
            smpl->iface->backend_reset(smpl);
            log_text.clear();
            ggml_tensor * r1 = row(1);
            check(refused(smpl, apply(smpl, g, r1, 1, 3, nullptr), r1) &&
                      strstr(clover_sampler_error(smpl), "not consecutive") != nullptr,
                  "a sequence's several rows without seq_logits are refused, naming why");
            smpl->iface->backend_reset(smpl);
            log_text.clear();
            check(refused(smpl, apply(smpl, g, r1, 1, 3, ggml_view_2d(g.ctx, rows, V, 2, rows->nb[1], 0)), r1),
                  "seq_logits of another number of rows than n_rows are refused");
            smpl->iface->backend_reset(smpl);
            log_text.clear();
            check(refused(smpl, apply(smpl, g, r1, 3, 3, seq3), r1), "a row past n_rows is refused");
            smpl->iface->backend_reset(smpl);
        }
        // calls for no row (a newer tree's unselected chains, an inactive sampler's dummy row): nothing built
        smpl->iface->backend_reset(smpl);
        out.clear();
        for (int64_t i = 0; i < 3; ++i) {
            out.push_back(apply(smpl, g, row(i), (int32_t) i, 3, seq3));
        }
        for (const auto & d : out) {
            ggml_build_forward_expand(g.gf, d.candidates);
        }
        const int n_nodes = ggml_graph_n_nodes(g.gf);
        for (int i = 0; i < 5; ++i) {
            ggml_tensor *      r0 = row(0);
            llama_sampler_data e  = apply(smpl, g, r0, -1);
            check(e.logits == r0 && e.candidates == nullptr && !e.refused, "a call for no row keeps llama.cpp's row");
        }
        check(clover_sampler_error(smpl) == nullptr && ggml_graph_n_nodes(g.gf) == n_nodes,
              "calls for no row add nothing to the graph");

        // a lone row of ggml_pad's copy (build_sampling's): read as passed, from the copy; a sequence's rows are read
        // from seq_logits, the padded copy not computed
        graph_ctx gp;
        ggml_tensor * src    = ggml_new_tensor_2d(gp.ctx, GGML_TYPE_F32, V, 2);
        ggml_tensor * padded = ggml_pad(gp.ctx, src, 0, 1, 0, 0);
        announce(smpl, 2);
        smpl->iface->backend_reset(smpl);
        llama_sampler_data p0 = apply(smpl, gp, ggml_view_1d(gp.ctx, padded, V, 0), 0);
        check(p0.candidates != nullptr, "a row of a padded copy is a known call");
        if (p0.candidates != nullptr) {
            ggml_build_forward_expand(gp.gf, p0.candidates);
            check(in_graph(gp.gf, GGML_OP_PAD), "a row of a padded copy is read from the copy it is a row of");
        }
        {
            graph_ctx gs;
            ggml_tensor * s2  = ggml_new_tensor_2d(gs.ctx, GGML_TYPE_F32, V, 2);
            ggml_tensor * pad = ggml_pad(gs.ctx, s2, 0, 1, 0, 0);
            smpl->iface->backend_reset(smpl);
            for (int32_t i = 0; i < 2; ++i) {
                llama_sampler_data d = apply(smpl, gs, ggml_view_1d(gs.ctx, pad, V, i * pad->nb[1]), i, 2, s2);
                if (d.candidates != nullptr) {
                    ggml_build_forward_expand(gs.gf, d.candidates);
                }
            }
            check(!in_graph(gs.gf, GGML_OP_PAD) && in_graph(gs.gf, GGML_OP_TOP_K),
                  "a sequence's rows are read from seq_logits, the padded copy not computed");
        }

        // no rows announced: nothing built on llama.cpp's rows; a row that is no view (the probe) is computed
        announce(smpl, 0);
        smpl->iface->backend_reset(smpl);
        ggml_tensor *      r0    = ggml_view_1d(gp.ctx, padded, V, 0);
        llama_sampler_data dummy = apply(smpl, gp, r0, -1);
        check(dummy.logits == r0 && dummy.candidates == nullptr && clover_sampler_error(smpl) == nullptr,
              "a sampler without announced rows leaves llama.cpp's row as it is, without a refusal");
        smpl->iface->backend_reset(smpl);
        ggml_tensor *      alone = ggml_new_tensor_1d(gp.ctx, GGML_TYPE_F32, 128 * 1024);
        llama_sampler_data a     = apply(smpl, gp, alone, -1);
        check(a.candidates != nullptr && clover_sampler_error(smpl) == nullptr,
              "a call for no row on a tensor of its own (llama.cpp's probe) is computed");
        llama_sampler_free(smpl);
    }

    // ---- one computation per sequence: a 32-row graph has about the nodes of a one-row graph (the outputs' 31
    // more slices), not 32 times as many (one run per row: 32 top_k / softmax nodes of one row each)
    {
        llama_sampler * smpl = make(buft, 32);
        announce(smpl, 32);
        auto nodes = [&](int32_t n) {
            graph_ctx g;
            ggml_tensor * rows = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, V, n);
            ggml_tensor * pad  = ggml_pad(g.ctx, rows, 0, 1, 0, 0);
            smpl->iface->backend_reset(smpl);
            for (int32_t i = n - 1; i >= 0; --i) {
                llama_sampler_data d = apply(smpl, g, ggml_view_1d(g.ctx, pad, V, i * pad->nb[1]), i, n, rows);
                if (d.candidates == nullptr) {
                    return -1;
                }
                ggml_build_forward_expand(g.gf, d.candidates);
            }
            return ggml_graph_n_nodes(g.gf);
        };
        const int n1 = nodes(1), n32 = nodes(32);
        check(n1 > 0 && n32 > 0 && n32 <= n1 + 2 * 31,
              "a 32-row graph has " + std::to_string(n32) + " nodes, a one-row graph " + std::to_string(n1) +
                  ": one computation per sequence, not per row");
        llama_sampler_free(smpl);
    }

    // ---- the outputs: the greedy choice of each row
    {
        std::mt19937                    rng(7);
        std::normal_distribution<float> normal;
        const int64_t                   n = 4;
        std::vector<float>              values(V * n);
        for (float & x : values) {
            x = normal(rng);
        }
        std::vector<int32_t> want(n);
        for (int64_t i = 0; i < n; ++i) {
            const float * r = values.data() + i * V;
            want[i]         = (int32_t) (std::max_element(r, r + V) - r);
        }
        llama_sampler * smpl = make(buft, 4);
        announce(smpl, (int32_t) n);
        check(greedy(smpl, backend, values, n) == want, "the greedy choices are the rows' argmax");
        llama_sampler * copy = llama_sampler_clone(smpl);
        check(copy != nullptr && greedy(copy, backend, values, n) == want, "a clone computes the same choices");
        // a sequence's rows interleaved with another's (rows 0, 2, 3 of the ubatch): no seq_logits, refused
        announce(smpl, 3);
        log_text.clear();
        check(greedy(smpl, backend, values, n, { 0, 2, 3 }).empty() && clover_sampler_error(smpl) != nullptr &&
                  log_text.find("not consecutive") != std::string::npos,
              "a sequence's rows interleaved with another's are refused");
        // a sequence's rows that are rows 1..3 of the ubatch: computed from there
        check(greedy(smpl, backend, values, n, { 1, 2, 3 }) == std::vector<int32_t>{ want[1], want[2], want[3] },
              "a sequence's rows after another's are its own");
        announce(smpl, (int32_t) n);

        // each call gets the inputs of the row llama.cpp says it is for, whatever the order of the calls: row k's
        // coefficients put +100 on id slot k, the calls made from the last row to the first
        {
            const int32_t      slot_ids[WIDTH] = { 5, 17, 2500, 999 };
            std::vector<float> c(3 * n * WIDTH, 0.0f);
            for (int64_t i = 0; i < n * WIDTH; ++i) {
                c[i] = c[n * WIDTH + i] = 1.0f;
            }
            for (int64_t k = 0; k < n; ++k) {
                c[2 * n * WIDTH + k * WIDTH + k] = 100.0f;
            }
            check(clover_sampler_set_inputs(smpl, slot_ids, WIDTH, (int32_t) n, c.data(), nullptr) == 0,
                  "set_inputs with per-row coefficients");
            check(greedy(smpl, backend, values, n, {}, { 3, 2, 1, 0 }) ==
                      std::vector<int32_t>{ slot_ids[3], slot_ids[2], slot_ids[1], slot_ids[0] },
                  "each call gets the inputs of its data.row, not of its place among the calls");
            check(greedy(smpl, backend, values, n, {}, { 2, 0, 3, 1 }) ==
                      std::vector<int32_t>{ slot_ids[2], slot_ids[0], slot_ids[3], slot_ids[1] },
                  "each call gets the slice of its data.row, calls in a shuffled order");
            announce(smpl, (int32_t) n);
        }

        // coefficients that decide (id 17 +100 in every row) and a row restricted to ids {2500, 999} (an allow mask)
        const int32_t      ids[WIDTH] = { 5, 17, 2500, 999 };
        std::vector<float> coef(3 * n * WIDTH, 0.0f);
        for (int64_t i = 0; i < n * WIDTH; ++i) {
            coef[i] = coef[n * WIDTH + i] = 1.0f;
        }
        for (int64_t i = 0; i < n; ++i) {
            coef[2 * n * WIDTH + i * WIDTH + 1] = 100.0f;
        }
        std::vector<int32_t> mask((V + 31) / 32, 0);
        for (int32_t t : { 2500, 999 }) {
            mask[t / 32] |= int32_t(1u << (t % 32));
        }
        const int32_t row_mask[n] = { -1, 0, -1, -1 };
        check(clover_sampler_set_inputs_ext(smpl, ids, WIDTH, (int32_t) n, coef.data(), WIDTH, nullptr, mask.data(),
                                            (int32_t) mask.size(), 1, row_mask) == WIDTH,
              "set_inputs_ext with a mask");
        const float * r1 = values.data() + 1 * V;
        const std::vector<int32_t> decided = { 17, r1[2500] >= r1[999] ? 2500 : 999, 17, 17 };
        llama_sampler * copy2 = llama_sampler_clone(smpl);
        check(greedy(smpl, backend, values, n) == decided, "the coefficients and the restriction decide the choice");
        check(copy2 != nullptr && greedy(copy2, backend, values, n) == decided,
              "a clone holds the inputs and the restriction");
        const int32_t one[1] = { 5 };
        check(copy2 != nullptr && clover_sampler_set_inputs(copy2, one, 1, 5, nullptr, nullptr) == -1,
              "a clone keeps the per-sequence row limit");
        llama_sampler_free(copy);
        llama_sampler_free(copy2);
        llama_sampler_free(smpl);
    }

    ggml_backend_free(backend);
    if (n_failed == 0) {
        printf("clover-sampler-test: all checks passed\n");
    }
    return n_failed == 0 ? 0 : 1;
}
