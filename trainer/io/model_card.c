/* The adapter's model card (README.md). See model_card.h. */
#include "trainer/io/model_card.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"

static const char *sched_name(int s) {
    return s == BT_SCHED_LINEAR ? "linear" : s == BT_SCHED_CONSTANT ? "constant" : "cosine";
}

/* A YAML double-quoted scalar: " and \ escaped, control characters dropped. */
static void yaml_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fputc('\\', f);
        if (c >= 0x20) fputc(c, f);
    }
    fputc('"', f);
}

/* Markdown inline code: a backtick in the text becomes ' (paths never need one). */
static void md_code(FILE *f, const char *s) {
    fputc('`', f);
    for (; s && *s; s++) fputc(*s == '`' ? '\'' : (unsigned char)*s < 0x20 ? ' ' : *s, f);
    fputc('`', f);
}

/* a preference objective's loss (pref) has no perplexity */
static void loss_cell(FILE *f, double loss, int pref) {
    if (isfinite(loss) && pref) fprintf(f, "%.4f", loss);
    else if (isfinite(loss)) fprintf(f, "%.4f (perplexity %.2f)", loss, exp(loss));
    else fputs("not evaluated", f);
}

char *bt_model_card_text(const bt_train_config *cfg, const bt_model_card_result *res) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return NULL;
    const char *base = cfg->base_model_name_or_path && *cfg->base_model_name_or_path
                           ? cfg->base_model_name_or_path : cfg->model;
    /* front matter: the keys PEFT's create_or_update_model_card sets (peft/peft_model.py) */
    fputs("---\nbase_model: ", f);
    yaml_str(f, base);
    fputs("\nlibrary_name: peft\npipeline_tag: text-generation\ntags:\n- ", f);
    char *tag = NULL;
    if (asprintf(&tag, "base_model:adapter:%s", base) < 0) tag = NULL;
    yaml_str(f, tag ? tag : "lora");
    free(tag);
    fputs("\n- lora\n- barqtrain\n---\n" BT_MODEL_CARD_MARK "\n\n", f);

    fprintf(f, "# LoRA adapter `%s`\n\n", cfg->name ? cfg->name : "run");
    fputs("A LoRA adapter for ", f);
    md_code(f, base);
    fprintf(f, ", trained by BarqTrain for %d of %d optimiser steps", res->step, cfg->steps);
    if (res->world > 1) fprintf(f, " on %d data-parallel ranks", res->world);
    fputs(".\n\n## Base model\n\n- base model: ", f);
    md_code(f, base);
    fputs("\n- model file trained against: ", f);
    md_code(f, cfg->model);
    fprintf(f, "\n- base weights held as: `%s`%s\n\n", bt_base_dtype_name(cfg->base_dtype),
            cfg->base_dtype == BT_BASE_GGUF ? " (the GGUF file's own quantised blocks: the "
            "weights llama.cpp runs)" : cfg->base_dtype == BT_BASE_NF4 ? " (NF4 with double "
            "quantisation, QLoRA)" : "");

    fputs("## Training data\n\n", f);
    for (int i = 0; i < cfg->data.n_shards; i++) {
        fputs("- ", f);
        md_code(f, cfg->data.shards[i]);
        fputc('\n', f);
    }
    fprintf(f, "- format: `%s`; rows of %d tokens (packed), %d rows per micro-batch, %d "
            "micro-batch(es) per step", cfg->data.format ? cfg->data.format : "?",
            cfg->data.seq_len, cfg->data.micro_batch_size, cfg->grad_accum);
    if (res->world > 1) fprintf(f, " per rank x %d ranks", res->world);
    fprintf(f, "; data seed %llu\n\n", (unsigned long long)cfg->data.seed);

    fputs("## Training hyper-parameters\n\n| key | value |\n|---|---|\n", f);
    fprintf(f, "| lora.r | %d |\n| lora.lora_alpha | %g |\n| lora.lora_dropout | %g |\n",
            cfg->lora.r, cfg->lora.alpha, cfg->lora.dropout);
    fputs("| lora.target_modules |", f);
    for (int m = 0, first = 1; m < BT_MOD_N; m++)
        if (cfg->lora.target_mask & (1u << m)) {
            fprintf(f, "%s%s", first ? " " : ", ", bt_module_name(m));
            first = 0;
        }
    fprintf(f, " |\n| optim.lr | %g |\n| optim.weight_decay | %g |\n| optim.beta1, beta2, eps | "
            "%g, %g, %g |\n| optim.warmup_steps | %d |\n| optim.grad_clip | %g |\n",
            cfg->optim.lr, cfg->optim.weight_decay, cfg->optim.beta1, cfg->optim.beta2,
            cfg->optim.eps, cfg->optim.warmup_steps, cfg->optim.grad_clip);
    fprintf(f, "| schedule | %s (min_lr_ratio %g) |\n| steps | %d |\n| seed | %llu |\n",
            sched_name(cfg->schedule), cfg->min_lr_ratio, cfg->steps,
            (unsigned long long)cfg->seed);
    fprintf(f, "| activation_checkpointing | %s |\n", cfg->activation_checkpointing ? "true" : "false");
    if (cfg->pref_on) /* TRL's names (trainer/preference.h) */
        fprintf(f, "| objective | %s (loss_type %s%s, beta %g) |\n", cfg->objective,
                bt_pref_loss_type_name(cfg->pref.loss_type[0]), cfg->pref.n_loss_types > 1 ? " + more" : "",
                cfg->pref.beta);
    else
        fputs("| objective | sft |\n", f);
    fputc('\n', f);

    fputs("## Results\n\n", f);
    if (isfinite(res->last_train_loss))
        fprintf(f, "- training loss at step %d: %.4f\n", res->step, res->last_train_loss);
    if (cfg->eval.n_shards > 0) {
        if (res->before_step > 0) fprintf(f, "- held-out loss at step %d (where this run resumed): ", res->before_step);
        else fputs("- held-out loss before training: ", f);
        loss_cell(f, res->loss_before, cfg->pref_on);
        fprintf(f, "\n- held-out loss after step %d: ", res->step);
        loss_cell(f, res->loss_after, cfg->pref_on);
        if (isfinite(res->loss_before) && isfinite(res->loss_after) && res->loss_before > 0)
            fprintf(f, " (%+.1f%%)", 100.0 * (res->loss_after - res->loss_before) / res->loss_before);
        if (res->eval_tokens > 0)
            fprintf(f, "\n- held-out set: %lld %s from", res->eval_tokens,
                    !cfg->pref_on ? "labelled tokens" : cfg->pref.algo == BT_PREF_KTO ? "examples" : "pairs");
        else
            fputs("\n- held-out set:", f);
        for (int i = 0; i < cfg->eval.n_shards; i++) {
            fputc(' ', f);
            md_code(f, cfg->eval.shards[i]);
        }
        fputc('\n', f);
    } else {
        fputs("- no held-out evaluation was configured (eval.shards)\n", f);
    }
    fputs("\nThe per-step metrics are in the run report (metrics.jsonl, report.png).\n\n", f);

    fputs("## How to use\n\nWith PEFT (Python):\n\n```python\nfrom transformers import "
          "AutoModelForCausalLM, AutoTokenizer\nfrom peft import PeftModel\n\nbase = "
          "AutoModelForCausalLM.from_pretrained(", f);
    yaml_str(f, base);
    fputs(")\nmodel = PeftModel.from_pretrained(base, \"path/to/this/directory\")\ntokenizer = "
          "AutoTokenizer.from_pretrained(", f);
    yaml_str(f, base);
    fputs(")\n```\n\nWith llama.cpp: convert the adapter to a LoRA GGUF and apply it to the base "
          "GGUF:\n\n```sh\ntrainer export --format gguf-lora --adapter path/to/this/directory "
          "--model ", f);
    fputs(cfg->model, f);
    fputs(" --out adapter.gguf\nllama-cli -m ", f);
    fputs(cfg->model, f);
    fputs(" --lora adapter.gguf -p \"...\"\n```\n\nOr with BarqTrain itself: `trainer generate "
          "--model ", f);
    fputs(cfg->model, f);
    fputs(" --adapter path/to/this/directory --prompt \"...\"`.\n\n", f);
    fputs("### Framework versions\n\n- BarqTrain (PEFT LoRA adapter format: adapter_config.json "
          "+ adapter_model.safetensors)\n", f);
    if (fclose(f) != 0) {
        free(buf);
        return NULL;
    }
    return buf;
}

int bt_model_card_write(const char *dir, const bt_train_config *cfg, const bt_model_card_result *res) {
    char *text = bt_model_card_text(cfg, res), *path = NULL;
    if (!text || asprintf(&path, "%s/README.md", dir) < 0) {
        free(text);
        return bt_fail(BT_ERR_NOMEM, "model card: out of memory");
    }
    bt_atomic_file af = {.fd = -1};
    int rc = bt_atomic_open(&af, path, "model card");
    if (!rc) rc = bt_atomic_write(&af, text, strlen(text));
    if (!rc) rc = bt_atomic_commit(&af);
    else bt_atomic_abort(&af);
    free(text);
    free(path);
    return rc;
}
