/* cmd_export.c -- `kiln export`: a training checkpoint as a Hugging Face folder, without
 * training (what `kiln train` writes to OUT/model at its end). */
#include "cli.h"

#include "base/base.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

static const char *export_help =
    "usage: kiln export RUN (-o | --out) DIR [-m MODEL] [--bf16 | --f32] [--overwrite]\n\n"
    "Writes the newest checkpoint of RUN (a `kiln train --out` folder, or its checkpoints\n"
    "folder) as a Hugging Face folder DIR, which `kiln generate DIR` and transformers load.\n"
    "The checkpoint records the model or --config it trained; -m MODEL names it for one\n"
    "that does not (made by an older kiln) or that has moved.\n\n"
    "  -o, --out DIR       the folder to write (refused if it exists, unless --overwrite)\n"
    "  -m, --model MODEL   the model the run fine-tuned (default: the one recorded)\n"
    "      --bf16, --f32   weights' type (default: f32 for an f32 run, else bf16, as train)\n"
    "      --overwrite     replace DIR\n";

/* A NUL-terminated copy of a JSON section of the newest checkpoint (NULL when absent). */
static char *section_text(const kiln_ckpt *c, const char *name) {
    const kiln_ckpt_section *sec = NULL;
    if (kiln_ckpt_find(c, name, KILN_CKPT_JSON, &sec) != KILN_OK) return NULL;
    char *s = malloc((size_t)sec->size + 1);
    if (!s) return NULL;
    memcpy(s, sec->data, (size_t)sec->size);
    s[sec->size] = 0;
    return s;
}

int cmd_export(int argc, char **argv) {
    const char *run = NULL, *out = NULL, *model = NULL;
    int overwrite = 0, dtype = -1; /* -1: as the run's storage; 0 f32; 1 bf16 */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(export_help, stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-o", &v, &err, "export") ||
                   cli_opt(argc, argv, &i, "--out", &v, &err, "export")) {
            out = v;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "export") ||
                   cli_opt(argc, argv, &i, "--model", &v, &err, "export")) {
            model = v;
        } else if (!strcmp(a, "--bf16")) {
            dtype = 1;
        } else if (!strcmp(a, "--f32")) {
            dtype = 0;
        } else if (!strcmp(a, "--overwrite")) {
            overwrite = 1;
        } else if (a[0] != '-' && !run) {
            run = a;
        } else {
            return cli_usage_error(
                "export", a[0] == '-' ? "unknown option '%s'" : "unexpected argument '%s'", a);
        }
        if (err) return 2;
    }
    if (!run || !out)
        return cli_usage_error(
            "export", "give the run folder and the folder to write: kiln export RUN -o DIR");
    char ckdir[4096];
    snprintf(ckdir, sizeof ckdir, "%s/checkpoints", run);
    if (!kiln_path_is_dir(ckdir)) snprintf(ckdir, sizeof ckdir, "%s", run);

    /* what the run trained, from its newest checkpoint: the model, the storage */
    kiln_ckpt *c = NULL;
    kiln_status st = kiln_ckpt_open_latest(ckdir, &c);
    if (st != KILN_OK) return cli_fail("export", ckdir, st);
    char *run_json = section_text(c, "run"), *cfg_json = section_text(c, "config");
    const uint64_t latest = kiln_ckpt_step(c); /* the newest valid one; a damaged newer one stays where it is */
    kiln_ckpt_close(c);
    char rec_model[4096] = "", rec_config[4096] = "", rec_tok[4096] = "", v[64];
    cli_run_value(run_json, "model", rec_model, sizeof rec_model);
    cli_run_value(run_json, "config", rec_config, sizeof rec_config);
    cli_run_value(run_json, "tokenizer", rec_tok, sizeof rec_tok);
    kiln_train_params tp = kiln_train_default_params();
    tp.max_seq = cli_run_value(run_json, "seq", v, sizeof v) ? atoi(v) : 64;
    if (tp.max_seq < 1) tp.max_seq = 64;
    tp.max_batch = 1;
    if (cli_run_value(cfg_json, "weight_storage", v, sizeof v))
        tp.weight_storage = (kiln_weight_storage)atoi(v);
    if (cli_run_value(cfg_json, "moment_storage", v, sizeof v))
        tp.moment_storage = (kiln_moment_storage)atoi(v);
    /* the trainer's extras (distillation's projections): made again, so the checkpoint loads;
     * not exported */
    enum { MAX_EXTRAS = 256 };
    kiln_train_extra extras[MAX_EXTRAS];
    char extra_names[MAX_EXTRAS][96];
    cJSON *cfg = cfg_json ? cJSON_Parse(cfg_json) : NULL;
    const cJSON *ex = cJSON_GetObjectItemCaseSensitive(cfg, "extras"), *e;
    cJSON_ArrayForEach(e, ex) {
        const cJSON *nm = cJSON_GetArrayItem(e, 0), *r = cJSON_GetArrayItem(e, 1), *cc = cJSON_GetArrayItem(e, 2);
        if (tp.n_extra == MAX_EXTRAS || !cJSON_IsString(nm) || !cJSON_IsNumber(r) || !cJSON_IsNumber(cc)) break;
        snprintf(extra_names[tp.n_extra], sizeof extra_names[0], "%s", nm->valuestring);
        extras[tp.n_extra] = (kiln_train_extra){extra_names[tp.n_extra], (int64_t)r->valuedouble, (int64_t)cc->valuedouble};
        tp.n_extra++;
    }
    tp.extra = extras;
    cJSON_Delete(cfg);
    free(run_json);
    free(cfg_json);

    kiln_model *m = NULL;
    const char *source = model ? model : rec_model[0] ? rec_model : rec_config;
    if (model || rec_model[0]) {
        st = kiln_model_open(source, NULL, &m);
    } else if (rec_config[0] && rec_tok[0]) {
        st = kiln_model_create(rec_config, rec_tok, 0,
                               &m); /* its weights come from the checkpoint */
    } else {
        fprintf(stderr,
                "kiln export: %s does not record the model it trained (an older kiln made it): "
                "pass -m MODEL\n",
                ckdir);
        return 2;
    }
    if (st != KILN_OK) {
        cli_fail("export", source, st);
        if (!model)
            fprintf(stderr, "kiln export: the run's model was '%s'; if it moved, pass -m MODEL\n",
                    source);
        return 1;
    }
    kiln_trainer *tr = NULL;
    uint64_t step = 0;
    int rc = 0;
    st = kiln_trainer_create(m, &tp, &tr);
    if (st != KILN_OK) rc = cli_fail("export", "trainer", st);
    /* that step exactly: an export reads, it does not set checkpoints aside as a resume does */
    if (!rc && (st = kiln_train_load_step(tr, ckdir, latest, NULL)) != KILN_OK)
        rc = cli_fail("export", ckdir, st);
    step = latest;
    if (!rc) {
        if (dtype < 0) dtype = tp.weight_storage != KILN_STORAGE_F32;
        st = kiln_train_export_hf(tr, out, dtype, overwrite);
        if (st != KILN_OK) {
            rc = cli_fail("export", out, st);
            if (!overwrite && kiln_path_is_dir(out))
                fprintf(stderr, "kiln export: pass --overwrite to replace '%s'\n", out);
        }
    }
    if (!rc)
        fprintf(stderr, "[kiln export] step %llu of %s -> %s (try: kiln generate %s -p \"...\")\n",
                (unsigned long long)step, ckdir, out, out);
    kiln_trainer_free(tr);
    kiln_model_close(m);
    return rc;
}
