/* Causal varlen GQA attention, with and without LongLoRA S^2-Attn: forward and backward against a
 * naive double-precision reference that applies the mask element by element (same document,
 * j <= i, and for S^2 the same group: floor((p_i + off) / G) == floor((p_j + off) / G) with p the
 * position inside the document and off = G/2 for heads h >= Hq/2, else 0), whose own gradient is
 * checked by central differences; several segments including length-1 segments, GQA and MQA
 * groups, segments longer than one query block (128) and one key tile (256). The attention pattern
 * itself is read back (V = identity, so out[i, h, j] = P(i attends j)) and compared with the rule:
 * no token attends to a later one, to another document or outside its group, and every allowed
 * pair has P > 0. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

static uint32_t rs = 777u;
static float frand(void)
{
    rs = rs * 1664525u + 1013904223u;
    return (float)((rs >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

typedef struct {
    int M, Hq, Hkv, D, n_seq;
    const int32_t *cu;
    double scale;
    int G; /* S^2 group (0 = full causal) */
    int W; /* sliding window (0 = none): key j visible to query i iff i - W < j <= i */
} shape;

/* may query i attend key j (absolute rows, both in segment sg) under head h: the mask, written
 * independently of the kernel's group bounds */
static int visible(const shape *s, int sg, int h, int i, int j)
{
    if (j > i)
        return 0;
    if (s->W > 0 && i - j >= s->W) /* outside the sliding window */
        return 0;
    if (s->G <= 0)
        return 1;
    const int off = h >= s->Hq / 2 ? s->G / 2 : 0, pi = i - s->cu[sg], pj = j - s->cu[sg];
    return (pi + off) / s->G == (pj + off) / s->G;
}

/* naive forward in double: out, lse */
static void ref_fwd(const shape *s, const double *q, const double *k, const double *v, double *out,
                    double *lse)
{
    const int Hq = s->Hq, Hkv = s->Hkv, D = s->D, grp = Hq / Hkv;
    double *p = malloc(sizeof(double) * s->M);
    for (int sg = 0; sg < s->n_seq; sg++)
        for (int h = 0; h < Hq; h++) {
            int g = h / grp;
            for (int i = s->cu[sg]; i < s->cu[sg + 1]; i++) {
                double mx = -INFINITY;
                for (int j = s->cu[sg]; j < s->cu[sg + 1]; j++) {
                    if (!visible(s, sg, h, i, j))
                        continue;
                    double d = 0;
                    for (int c = 0; c < D; c++)
                        d += q[(i * Hq + h) * D + c] * k[(j * Hkv + g) * D + c];
                    p[j] = d * s->scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                double se = 0;
                for (int j = s->cu[sg]; j < s->cu[sg + 1]; j++)
                    if (visible(s, sg, h, i, j))
                        se += exp(p[j] - mx);
                lse[i * Hq + h] = mx + log(se);
                for (int c = 0; c < D; c++) {
                    double o = 0;
                    for (int j = s->cu[sg]; j < s->cu[sg + 1]; j++)
                        if (visible(s, sg, h, i, j))
                            o += exp(p[j] - lse[i * Hq + h]) * v[(j * Hkv + g) * D + c];
                    out[(i * Hq + h) * D + c] = o;
                }
            }
        }
    free(p);
}

/* analytic backward in double (same formulas as the kernel, naive loops) */
static void ref_bwd(const shape *s, const double *q, const double *k, const double *v,
                    const double *dout, double *dq, double *dk, double *dv)
{
    const int M = s->M, Hq = s->Hq, Hkv = s->Hkv, D = s->D, grp = Hq / Hkv;
    double *out = malloc(sizeof(double) * M * Hq * D), *lse = malloc(sizeof(double) * M * Hq);
    ref_fwd(s, q, k, v, out, lse);
    memset(dq, 0, sizeof(double) * M * Hq * D);
    memset(dk, 0, sizeof(double) * M * Hkv * D);
    memset(dv, 0, sizeof(double) * M * Hkv * D);
    for (int sg = 0; sg < s->n_seq; sg++)
        for (int h = 0; h < Hq; h++) {
            int g = h / grp;
            for (int i = s->cu[sg]; i < s->cu[sg + 1]; i++) {
                double di = 0;
                for (int c = 0; c < D; c++)
                    di += dout[(i * Hq + h) * D + c] * out[(i * Hq + h) * D + c];
                for (int j = s->cu[sg]; j <= i; j++) {
                    if (!visible(s, sg, h, i, j))
                        continue;
                    double sc = 0, dp = 0;
                    for (int c = 0; c < D; c++) {
                        sc += q[(i * Hq + h) * D + c] * k[(j * Hkv + g) * D + c];
                        dp += dout[(i * Hq + h) * D + c] * v[(j * Hkv + g) * D + c];
                    }
                    double P = exp(sc * s->scale - lse[i * Hq + h]);
                    double ds = P * (dp - di);
                    for (int c = 0; c < D; c++) {
                        dv[(j * Hkv + g) * D + c] += P * dout[(i * Hq + h) * D + c];
                        dq[(i * Hq + h) * D + c] += s->scale * ds * k[(j * Hkv + g) * D + c];
                        dk[(j * Hkv + g) * D + c] += s->scale * ds * q[(i * Hq + h) * D + c];
                    }
                }
            }
        }
    free(out), free(lse);
}

static double ref_loss(const shape *s, const double *q, const double *k, const double *v,
                       const double *dout)
{
    const int n = s->M * s->Hq * s->D;
    double *out = malloc(sizeof(double) * n), *lse = malloc(sizeof(double) * s->M * s->Hq);
    ref_fwd(s, q, k, v, out, lse);
    double L = 0;
    for (int i = 0; i < n; i++)
        L += out[i] * dout[i];
    free(out), free(lse);
    return L;
}

static void check_close(const char *what, const float *a, const double *b, int n, double rtol,
                        double atol)
{
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (!(fabs(a[i] - b[i]) <= atol + rtol * fabs(b[i])))
            bad = i;
    if (bad >= 0)
        print_error("%s[%d]: %.9g vs ref %.9g\n", what, bad, a[bad], b[bad]);
    assert_int_equal(bad, -1);
}

static void run(const shape *s, int fd_check)
{
    const int M = s->M, nq = M * s->Hq * s->D, nkv = M * s->Hkv * s->D;
    float *q = malloc(4 * nq), *k = malloc(4 * nkv), *v = malloc(4 * nkv), *dout = malloc(4 * nq);
    double *qd = malloc(8 * nq), *kd = malloc(8 * nkv), *vd = malloc(8 * nkv), *dod = malloc(8 * nq);
    for (int i = 0; i < nq; i++) {
        q[i] = 2.0f * frand();
        dout[i] = frand();
        qd[i] = q[i], dod[i] = dout[i];
    }
    for (int i = 0; i < nkv; i++) {
        k[i] = 2.0f * frand();
        v[i] = frand();
        kd[i] = k[i], vd[i] = v[i];
    }
    float *out = malloc(4 * nq), *lse = malloc(4 * M * s->Hq);
    float *dq = malloc(4 * nq), *dk = malloc(4 * nkv), *dv = malloc(4 * nkv);
    double *outr = malloc(8 * nq), *lser = malloc(8 * M * s->Hq);
    double *dqr = malloc(8 * nq), *dkr = malloc(8 * nkv), *dvr = malloc(8 * nkv);
    for (int i = 0; i < nkv; i++)
        dk[i] = dv[i] = NAN; /* must be overwritten */
    if (s->W > 0) {
        assert_int_equal(bt_attn_fwd_win(out, lse, q, k, v, s->cu, s->n_seq, M, s->Hq, s->Hkv,
                                         s->D, (float)s->scale, s->G, s->W), 0);
        assert_int_equal(bt_attn_bwd_win(dq, dk, dv, dout, out, lse, q, k, v, s->cu, s->n_seq, M,
                                         s->Hq, s->Hkv, s->D, (float)s->scale, s->G, s->W), 0);
    } else if (s->G == 0) { /* the plain entry points */
        bt_attn_fwd(out, lse, q, k, v, s->cu, s->n_seq, M, s->Hq, s->Hkv, s->D, (float)s->scale);
        bt_attn_bwd(dq, dk, dv, dout, out, lse, q, k, v, s->cu, s->n_seq, M, s->Hq, s->Hkv, s->D,
                    (float)s->scale);
    } else {
        assert_int_equal(bt_attn_fwd_s2(out, lse, q, k, v, s->cu, s->n_seq, M, s->Hq, s->Hkv, s->D,
                                        (float)s->scale, s->G), 0);
        assert_int_equal(bt_attn_bwd_s2(dq, dk, dv, dout, out, lse, q, k, v, s->cu, s->n_seq, M,
                                        s->Hq, s->Hkv, s->D, (float)s->scale, s->G), 0);
    }
    ref_fwd(s, qd, kd, vd, outr, lser);
    ref_bwd(s, qd, kd, vd, dod, dqr, dkr, dvr);
    check_close("out", out, outr, nq, 1e-4, 1e-5);
    check_close("lse", lse, lser, M * s->Hq, 1e-5, 1e-5);
    check_close("dq", dq, dqr, nq, 1e-3, 1e-4);
    check_close("dk", dk, dkr, nkv, 1e-3, 1e-4);
    check_close("dv", dv, dvr, nkv, 1e-3, 1e-4);
    if (fd_check) {
        /* the reference gradient itself vs central differences of sum(out * dout) */
        const double h = 1e-6;
        double *bufs[3] = {qd, kd, vd}, *grads[3] = {dqr, dkr, dvr};
        int ns[3] = {nq, nkv, nkv};
        for (int b = 0; b < 3; b++)
            for (int i = 0; i < ns[b]; i++) {
                double o = bufs[b][i];
                bufs[b][i] = o + h;
                double lp = ref_loss(s, qd, kd, vd, dod);
                bufs[b][i] = o - h;
                double lm = ref_loss(s, qd, kd, vd, dod);
                bufs[b][i] = o;
                double fd = (lp - lm) / (2 * h);
                if (!(fabs(fd - grads[b][i]) <= 1e-6 + 1e-5 * fabs(fd)))
                    fail_msg("fd check buf %d [%d]: fd %.9g analytic %.9g", b, i, fd, grads[b][i]);
            }
    }
    free(q), free(k), free(v), free(dout), free(qd), free(kd), free(vd), free(dod), free(out);
    free(lse), free(dq), free(dk), free(dv), free(outr), free(lser), free(dqr), free(dkr), free(dvr);
}

/* The attention pattern itself: V = identity (D >= the longest segment; value row j of a segment
 * is e_(j - segment start)), so out[i, h, j - start] is the probability that query i attends key
 * j. It must be > 0 exactly where `visible` allows, and exactly 0 elsewhere (a later token,
 * another document, another S^2 group). */
static void check_pattern(const shape *s)
{
    const int M = s->M, Hq = s->Hq, Hkv = s->Hkv, D = s->D, grp = Hq / Hkv;
    float *q = malloc(4 * (size_t)M * Hq * D), *k = malloc(4 * (size_t)M * Hkv * D);
    float *v = calloc((size_t)M * Hkv * D, 4), *out = malloc(4 * (size_t)M * Hq * D);
    float *lse = malloc(4 * (size_t)M * Hq);
    for (int i = 0; i < M * Hq * D; i++)
        q[i] = 0.3f * frand();
    for (int i = 0; i < M * Hkv * D; i++)
        k[i] = 0.3f * frand();
    for (int sg = 0; sg < s->n_seq; sg++) {
        assert_true(s->cu[sg + 1] - s->cu[sg] <= D);
        for (int j = s->cu[sg]; j < s->cu[sg + 1]; j++)
            for (int g = 0; g < Hkv; g++)
                v[((size_t)j * Hkv + g) * D + (j - s->cu[sg])] = 1.0f;
    }
    assert_int_equal(bt_attn_fwd_win(out, lse, q, k, v, s->cu, s->n_seq, M, Hq, Hkv, D,
                                     (float)s->scale, s->G, s->W), 0);
    int n_vis = 0;
    for (int sg = 0; sg < s->n_seq; sg++)
        for (int h = 0; h < Hq; h++)
            for (int i = s->cu[sg]; i < s->cu[sg + 1]; i++) {
                const float *o = out + ((size_t)i * Hq + h) * D;
                double sum = 0;
                for (int c = 0; c < D; c++) {
                    const int j = s->cu[sg] + c, in_seg = j < s->cu[sg + 1];
                    const int vis = in_seg && visible(s, sg, h, i, j);
                    if (vis ? !(o[c] > 0.0f) : o[c] != 0.0f)
                        fail_msg("W %d G %d head %d (kv %d): query %d, key %d: P = %g but the mask says "
                                 "%s", s->W, s->G, h, h / grp, i, j, o[c], vis ? "visible" : "hidden");
                    n_vis += vis;
                    sum += o[c];
                }
                assert_true(fabs(sum - 1.0) < 1e-5); /* a distribution over its own keys only */
            }
    assert_true(n_vis > 0);
    free(q), free(k), free(v), free(out), free(lse);
}

static void test_segments_gqa(void **state)
{
    (void)state;
    /* segments of 5, 1, 0, 4, 1 tokens; 4 query heads over 2 kv heads */
    static const int32_t cu[6] = {0, 5, 6, 6, 10, 11};
    shape s = {11, 4, 2, 8, 5, cu, 1.0 / sqrt(8.0), 0, 0};
    run(&s, 1);
}

static void test_mha_and_mqa(void **state)
{
    (void)state;
    static const int32_t cu[3] = {0, 7, 9};
    shape mha = {9, 3, 3, 4, 2, cu, 0.5, 0, 0};
    run(&mha, 1);
    shape mqa = {9, 3, 1, 4, 2, cu, 0.5, 0, 0};
    run(&mqa, 1);
}

static void test_long_segment_blocks(void **state)
{
    (void)state;
    /* 300-token segment = query blocks of 128, 128, 44 and key tiles of 256, 44; SmolLM2-like head
     * ratio 3:1 */
    static const int32_t cu[3] = {0, 300, 301};
    shape s = {301, 3, 1, 16, 2, cu, 0.25, 0, 0};
    run(&s, 0);
}

/* S^2-Attn, small: group fractions 1/2, 1/4, 1/8 of a 16-token row, packed documents (so groups
 * restart at each document), GQA with the query heads of one kv head on both sides of Hq/2, and an
 * odd head count (Hq/2 rounds down, as LongLoRA's num_heads // 2); gradients also by finite
 * differences of the reference */
static void test_s2_small(void **state)
{
    (void)state;
    static const int32_t cu[5] = {0, 7, 8, 16, 19}; /* docs of 7, 1, 8 tokens; a second row of 3 */
    for (int G = 2; G <= 8; G *= 2) {
        shape gqa = {19, 4, 2, 8, 4, cu, 1.0 / sqrt(8.0), G, 0};
        run(&gqa, 1);
        shape odd = {19, 3, 1, 4, 4, cu, 0.5, G, 0};
        run(&odd, G == 4);
    }
}

/* S^2 over blocks and tiles: a 600-token document (several 128-query blocks and 256-key tiles per
 * group) with groups of 150 and 400 (not multiples of the block sizes), plus a second document;
 * SmolLM2's 9:3 heads */
static void test_s2_long(void **state)
{
    (void)state;
    static const int32_t cu[3] = {0, 600, 731};
    shape a = {731, 9, 3, 8, 2, cu, 0.35, 150, 0};
    run(&a, 0);
    shape b = {731, 9, 3, 8, 2, cu, 0.35, 400, 0};
    run(&b, 0);
}

static void test_s2_pattern(void **state)
{
    (void)state;
    static const int32_t cu[5] = {0, 13, 14, 40, 47}; /* docs of 13, 1, 26, 7 tokens */
    for (int G = 0; G <= 16; G += 2) {
        shape gqa = {47, 6, 2, 32, 4, cu, 0.3, G, 0};
        check_pattern(&gqa);
        shape odd = {47, 9, 3, 32, 4, cu, 0.3, G, 0};
        check_pattern(&odd);
    }
    /* long enough for several query blocks and key tiles per group */
    static const int32_t cu2[3] = {0, 520, 600};
    shape big = {600, 2, 1, 520, 2, cu2, 0.3, 300, 0};
    check_pattern(&big);
}

static void test_s2_bad_group(void **state)
{
    (void)state;
    static const int32_t cu[2] = {0, 4};
    float x[4 * 2 * 4] = {0}, o[4 * 2 * 4], l[8], g[3][4 * 2 * 4];
    assert_int_equal(bt_attn_fwd_s2(o, l, x, x, x, cu, 1, 4, 2, 2, 4, 1.0f, 3), -6);
    assert_int_equal(bt_attn_fwd_s2(o, l, x, x, x, cu, 1, 4, 2, 2, 4, 1.0f, -2), -6);
    assert_int_equal(bt_attn_bwd_s2(g[0], g[1], g[2], x, x, l, x, x, x, cu, 1, 4, 2, 2, 4, 1.0f, 5),
                     -6);
    /* the group bounds helper */
    assert_int_equal(bt_s2_group_end(0, 8, 0), 8);
    assert_int_equal(bt_s2_group_end(7, 8, 0), 8);
    assert_int_equal(bt_s2_group_end(8, 8, 0), 16);
    assert_int_equal(bt_s2_group_end(0, 8, 1), 4);
    assert_int_equal(bt_s2_group_end(3, 8, 1), 4);
    assert_int_equal(bt_s2_group_end(4, 8, 1), 12);
    assert_int_equal(bt_s2_group_end(11, 8, 1), 12);
}

/* Sliding-window attention (Mistral / Gemma 3 local layers): key j visible to query i iff
 * i - W < j <= i inside its document; against the brute-force masked reference (and its gradient
 * by central differences), windows of 1 (each token sees only itself), 2, 3, 5 and wider than the
 * documents (= causal), with GQA / MQA, alone and with S^2 groups */
static void test_window_small(void **state)
{
    (void)state;
    static const int32_t cu[5] = {0, 7, 8, 16, 19};
    const int ws[5] = {1, 2, 3, 5, 40};
    for (int w = 0; w < 5; w++) {
        shape gqa = {19, 4, 2, 8, 4, cu, 1.0 / sqrt(8.0), 0, ws[w]};
        run(&gqa, ws[w] == 3);
        shape mqa = {19, 3, 1, 4, 4, cu, 0.5, 0, ws[w]};
        run(&mqa, 0);
        shape s2 = {19, 4, 2, 8, 4, cu, 0.4, 4, ws[w]};
        run(&s2, ws[w] == 2);
    }
}

/* windows across query blocks (128) and key tiles (256): a 600-token document with windows of
 * 100, 128, 300 and 512 (Gemma 3's 512), plus a second document; the pattern read back too */
static void test_window_long(void **state)
{
    (void)state;
    static const int32_t cu[3] = {0, 600, 731};
    const int ws[4] = {100, 128, 300, 512};
    for (int w = 0; w < 4; w++) {
        shape a = {731, 4, 1, 8, 2, cu, 0.35, 0, ws[w]};
        run(&a, 0);
    }
    static const int32_t cu2[5] = {0, 13, 14, 40, 47};
    for (int W = 1; W <= 9; W += 4) {
        shape p = {47, 6, 2, 32, 4, cu2, 0.3, 0, W};
        check_pattern(&p);
        shape p2 = {47, 6, 2, 32, 4, cu2, 0.3, 8, W};
        check_pattern(&p2);
    }
    static const int32_t cu3[3] = {0, 520, 600};
    shape big = {600, 2, 1, 520, 2, cu3, 0.3, 0, 300};
    check_pattern(&big);
    float x[4 * 2 * 4] = {0}, o[4 * 2 * 4], l[8];
    static const int32_t c1[2] = {0, 4};
    assert_int_equal(bt_attn_fwd_win(o, l, x, x, x, c1, 1, 4, 2, 2, 4, 1.0f, 0, -1), -6);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_small),
        cmocka_unit_test(test_window_long),
        cmocka_unit_test(test_segments_gqa),
        cmocka_unit_test(test_mha_and_mqa),
        cmocka_unit_test(test_long_segment_blocks),
        cmocka_unit_test(test_s2_small),
        cmocka_unit_test(test_s2_long),
        cmocka_unit_test(test_s2_pattern),
        cmocka_unit_test(test_s2_bad_group),
    };
    return cmocka_run_group_tests_name("attention", tests, NULL, NULL);
}
