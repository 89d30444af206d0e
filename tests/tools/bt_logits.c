/* bt_logits: BarqTrain's logits for one token sequence at chosen positions, for the reference
 * cross-checks in Python (tests/reference/check_exports.py --context-extension):
 *
 *   bt_logits --model BASE.gguf|HF_DIR [--adapter PEFT_DIR] --ids 1,2,3 --pos0 P --out FILE
 *
 * Loads the base with fp32 linears (as `trainer export` does), the adapter when given (applying
 * the context extension its adapter_config.json records, trainer/io/adapter_load.h), and writes the
 * logits of the sequence at position_ids P, P+1, ... (one causal segment; full attention) as raw
 * little-endian float32 [n, vocab] to FILE (step.h bt_forward_logits). Prints "n vocab ctx" on
 * stdout. Exit 0, 1 (runtime error, message on stderr) or 2 (usage). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "trainer/io/adapter_load.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/step.h"

/* The usage text on f; returns rc (2: a usage error, 0: --help). */
static int usage(FILE *f, int rc) {
    fprintf(f, "usage: bt_logits --model BASE --ids 1,2,3 --pos0 P --out FILE [--adapter DIR]\n");
    return rc;
}

int main(int argc, char **argv) {
    const char *model = NULL, *adapter = NULL, *ids_s = NULL, *out = NULL;
    long pos0 = 0;
    static const struct option lopts[] = {
        {"model", required_argument, NULL, 'm'}, {"adapter", required_argument, NULL, 'a'},
        {"ids", required_argument, NULL, 'i'},   {"out", required_argument, NULL, 'o'},
        {"pos0", required_argument, NULL, 'p'},  {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'a': adapter = optarg; break;
        case 'i': ids_s = optarg; break;
        case 'o': out = optarg; break;
        case 'p': pos0 = strtol(optarg, NULL, 10); break;
        case 'h': return usage(stdout, 0);
        default: return usage(stderr, 2);
        }
    }
    if (optind != argc || !model || !ids_s || !out || pos0 < 0 || pos0 > (1L << 30)) return usage(stderr, 2);
    int n = 1;
    for (const char *p = ids_s; *p; p++) n += *p == ',';
    int32_t *ids = calloc((size_t)n, 4), *lab = calloc((size_t)n, 4), *pos = calloc((size_t)n, 4);
    char *end = (char *)ids_s;
    for (int i = 0; i < n; i++) {
        ids[i] = (int32_t)strtol(end, &end, 10);
        if (*end == ',') end++;
        lab[i] = -100;
        pos[i] = (int32_t)(pos0 + i);
    }
    bt_model m;
    bt_lora lo;
    memset(&lo, 0, sizeof lo);
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    int rc = bt_model_load(&m, model, &o);
    if (!rc && adapter) rc = bt_lora_load_peft(&lo, &m, adapter);
    if (!rc && adapter) rc = bt_adapter_apply_context(&m, adapter);
    bt_step_ctx *ctx = NULL;
    float *lg = NULL;
    if (!rc) rc = bt_step_ctx_new(&ctx, &m, adapter ? &lo : NULL, n, 0);
    if (!rc) {
        int32_t cu[2] = {0, n};
        bt_microbatch mb = {1, n, ids, lab, pos, cu, 2};
        lg = malloc((size_t)n * m.hp.vocab * sizeof(float));
        rc = lg ? bt_forward_logits(ctx, &m, adapter ? &lo : NULL, &mb, lg) : BT_ERR_NOMEM;
    }
    if (!rc) {
        FILE *f = fopen(out, "wb");
        if (!f || fwrite(lg, sizeof(float), (size_t)n * m.hp.vocab, f) != (size_t)n * m.hp.vocab ||
            fclose(f) != 0)
            rc = bt_fail(BT_ERR_IO, "cannot write %s", out);
        else
            printf("%d %d %d\n", n, m.hp.vocab, m.hp.ctx);
    }
    if (rc) fprintf(stderr, "bt_logits: %s\n", bt_last_error());
    free(lg);
    bt_step_ctx_free(ctx);
    bt_lora_free(&lo);
    bt_model_free(&m);
    free(ids), free(lab), free(pos);
    return rc ? 1 : 0;
}
