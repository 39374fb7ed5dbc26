/* cmd_info.c -- `kiln info`: what a model file holds. */
#include "cli.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

static const char *info_help =
    "usage: kiln info [-m] MODEL [--json] [--no-tensors]\n\n"
    "Architecture, parameter count, tensors with types and shapes, tokenizer and chat template.\n";

int cmd_info(int argc, char **argv) {
    const char *model = NULL;
    int json = 0, tensors = 1;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int err = 0;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(info_help, stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "info") || cli_opt(argc, argv, &i, "--model", &v, &err, "info")) {
            model = v;
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "--no-tensors")) {
            tensors = 0;
        } else if (argv[i][0] != '-' && !model) {
            model = argv[i]; /* kiln info MODEL */
        } else {
            return cli_usage_error("info", "unknown option '%s'", argv[i]);
        }
        if (err) return 2;
    }
    if (!model) return cli_usage_error("info", "a model is required (kiln info MODEL or -m MODEL)");
    kiln_model *m = NULL;
    kiln_status st = kiln_model_open(model, NULL, &m);
    if (st != KILN_OK) return cli_fail("info", model, st);
    kiln_model_info mi;
    kiln_tokenizer_info ti;
    kiln_model_get_info(m, &mi);
    kiln_tokenizer_get_info(kiln_model_get_tokenizer(m), &ti);
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "architecture", mi.architecture);
        cJSON_AddStringToObject(o, "name", mi.name);
        cJSON_AddNumberToObject(o, "n_params", (double)mi.n_params);
        cJSON_AddNumberToObject(o, "weight_bytes", (double)mi.weight_bytes);
        cJSON_AddNumberToObject(o, "n_layer", mi.n_layer);
        cJSON_AddNumberToObject(o, "n_embd", mi.n_embd);
        cJSON_AddNumberToObject(o, "n_head", mi.n_head);
        cJSON_AddNumberToObject(o, "n_head_kv", mi.n_head_kv);
        cJSON_AddNumberToObject(o, "head_dim", mi.head_dim);
        cJSON_AddNumberToObject(o, "n_ff", mi.n_ff);
        cJSON_AddNumberToObject(o, "n_vocab", mi.n_vocab);
        cJSON_AddNumberToObject(o, "n_ctx_train", mi.n_ctx_train);
        cJSON_AddNumberToObject(o, "rms_norm_eps", mi.rms_norm_eps);
        cJSON_AddNumberToObject(o, "rope_theta", mi.rope_theta);
        cJSON_AddBoolToObject(o, "tied_embeddings", mi.tied_embeddings);
        cJSON *t = cJSON_AddObjectToObject(o, "tokenizer");
        cJSON_AddStringToObject(t, "type", ti.type ? ti.type : "");
        cJSON_AddStringToObject(t, "pre", ti.pre ? ti.pre : "");
        cJSON_AddNumberToObject(t, "n_vocab", ti.n_vocab);
        cJSON_AddNumberToObject(t, "bos_id", ti.bos_id);
        cJSON_AddNumberToObject(t, "eos_id", ti.eos_id);
        cJSON_AddStringToObject(t, "chat_template", ti.chat_template_name ? ti.chat_template_name : (ti.chat_template ? "unknown" : "none"));
        if (tensors) {
            cJSON *arr = cJSON_AddArrayToObject(o, "tensors");
            for (int i = 0; i < mi.n_tensors; i++) {
                kiln_tensor_info tinfo;
                if (kiln_model_get_tensor_info(m, i, &tinfo) != KILN_OK) continue;
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "name", tinfo.name);
                cJSON_AddStringToObject(e, "dtype", kiln_dtype_name(tinfo.dtype));
                cJSON *sh = cJSON_AddArrayToObject(e, "shape");
                for (int d = 0; d < tinfo.n_dims; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)tinfo.shape[d]));
                cJSON_AddItemToArray(arr, e);
            }
        }
        char *s = cJSON_Print(o);
        if (s) puts(s);
        free(s);
        cJSON_Delete(o);
    } else {
        printf("model:        %s\n", model);
        printf("name:         %s\n", mi.name);
        printf("architecture: %s\n", mi.architecture);
        printf("parameters:   %llu (%.1f M)\n", (unsigned long long)mi.n_params, (double)mi.n_params / 1e6);
        printf("weights:      %.1f MiB\n", (double)mi.weight_bytes / (1024.0 * 1024.0));
        printf("layers %d, width %d, heads %d (kv %d) x %d, ffn %d, vocab %d, context %d\n",
               mi.n_layer, mi.n_embd, mi.n_head, mi.n_head_kv, mi.head_dim, mi.n_ff, mi.n_vocab,
               mi.n_ctx_train);
        printf("rms eps %g, rope theta %g, tied embeddings %s, qkv bias %s, qk norm %s\n",
               (double)mi.rms_norm_eps, (double)mi.rope_theta, mi.tied_embeddings ? "yes" : "no",
               mi.attn_bias ? "yes" : "no", mi.qk_norm ? "yes" : "no");
        printf("tokenizer:    %s (pre %s), %d tokens, bos %d, eos %d\n", ti.type ? ti.type : "?",
               ti.pre ? ti.pre : "?", ti.n_vocab, ti.bos_id, ti.eos_id);
        printf("chat:         %s\n", ti.chat_template_name ? ti.chat_template_name
                                     : (ti.chat_template ? "unknown template (not supported)" : "none"));
        if (tensors) {
            printf("tensors (%d):\n", mi.n_tensors);
            for (int i = 0; i < mi.n_tensors; i++) {
                kiln_tensor_info tinfo;
                if (kiln_model_get_tensor_info(m, i, &tinfo) != KILN_OK) continue;
                printf("  %-48s %-5s (", tinfo.name, kiln_dtype_name(tinfo.dtype));
                for (int d = 0; d < tinfo.n_dims; d++) printf(d ? ", %lld" : "%lld", (long long)tinfo.shape[d]);
                printf(")\n");
            }
        }
    }
    kiln_model_close(m);
    return 0;
}
