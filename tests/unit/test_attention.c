/* Causal varlen GQA attention: forward and backward against a naive double-precision reference,
 * whose own gradient is checked by central differences; several segments including length-1
 * segments, GQA groups, and a segment longer than one query block (128). */
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
} shape;

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
                for (int j = s->cu[sg]; j <= i; j++) {
                    double d = 0;
                    for (int c = 0; c < D; c++)
                        d += q[(i * Hq + h) * D + c] * k[(j * Hkv + g) * D + c];
                    p[j] = d * s->scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                double se = 0;
                for (int j = s->cu[sg]; j <= i; j++)
                    se += exp(p[j] - mx);
                lse[i * Hq + h] = mx + log(se);
                for (int c = 0; c < D; c++) {
                    double o = 0;
                    for (int j = s->cu[sg]; j <= i; j++)
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
    bt_attn_fwd(out, lse, q, k, v, s->cu, s->n_seq, M, s->Hq, s->Hkv, s->D, (float)s->scale);
    bt_attn_bwd(dq, dk, dv, dout, out, lse, q, k, v, s->cu, s->n_seq, M, s->Hq, s->Hkv, s->D,
                (float)s->scale);
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

static void test_segments_gqa(void **state)
{
    (void)state;
    /* segments of 5, 1, 0, 4, 1 tokens; 4 query heads over 2 kv heads */
    static const int32_t cu[6] = {0, 5, 6, 6, 10, 11};
    shape s = {11, 4, 2, 8, 5, cu, 1.0 / sqrt(8.0)};
    run(&s, 1);
}

static void test_mha_and_mqa(void **state)
{
    (void)state;
    static const int32_t cu[3] = {0, 7, 9};
    shape mha = {9, 3, 3, 4, 2, cu, 0.5};
    run(&mha, 1);
    shape mqa = {9, 3, 1, 4, 2, cu, 0.5};
    run(&mqa, 1);
}

static void test_long_segment_blocks(void **state)
{
    (void)state;
    /* 300-token segment = query blocks of 128, 128, 44; SmolLM2-like head ratio 3:1 */
    static const int32_t cu[3] = {0, 300, 301};
    shape s = {301, 3, 1, 16, 2, cu, 0.25};
    run(&s, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_segments_gqa),
        cmocka_unit_test(test_mha_and_mqa),
        cmocka_unit_test(test_long_segment_blocks),
    };
    return cmocka_run_group_tests_name("attention", tests, NULL, NULL);
}
