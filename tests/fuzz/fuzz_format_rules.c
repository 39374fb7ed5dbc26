/* fuzz_format_rules.c -- libFuzzer target: any bytes as --format's rules against a 4-layer
 * llama (tied head) whose matrices are tensors at distinct fake addresses. A spec that resolves
 * gives a sorted table of disjoint ranges, each one of the model's weights in a format other
 * than the base, with a known format; any other outcome is an error with a message. */
#include "models/format_rules.h"

#include <stdlib.h>
#include <string.h>

#define LAYERS 4

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int dflt = data[0] % 3;
    char *rules = malloc(size);
    if (!rules) return 0;
    memcpy(rules, data + 1, size - 1);
    rules[size - 1] = '\0';

    const kiln_arch_desc *a = kiln_arch_get(KILN_ARCH_LLAMA);
    kiln_model_config c;
    memset(&c, 0, sizeof c);
    c.n_layer = LAYERS;
    c.tie_embeddings = 1;
    kiln_wref refs[64], layer_refs[LAYERS * 32];
    kiln_tensor t[LAYERS * 32 + 1];
    memset(refs, 0, sizeof refs);
    memset(layer_refs, 0, sizeof layer_refs);
    memset(t, 0, sizeof t);
    if (a->n_roles > 64 || a->n_layer_roles > 32) __builtin_trap();
    static char mem[(LAYERS * 32 + 1) * 64]; /* the fake weights: 64 bytes each */
    int n_t = 0;
    for (int l = 0; l < LAYERS; l++)
        for (int i = 0; i < a->n_layer_roles; i++) {
            kiln_tensor *x = &t[n_t];
            x->data = mem + 64 * n_t++;
            x->nbytes = 64;
            layer_refs[l * a->n_layer_roles + i].mat = x;
        }
    t[n_t].data = mem + 64 * n_t;
    t[n_t].nbytes = 64;
    refs[a->role_embed].mat = &t[n_t];

    kiln_weight_formats wf;
    int any = 0;
    kiln_status st = kiln_format_rules_resolve(rules, dflt, 0, a, &c, refs, layer_refs, &t[n_t], "fuzz", &wf, &any);
    if (st != KILN_OK) {
        if (wf.e || wf.n || !kiln_last_error()[0]) __builtin_trap();
    } else {
        for (int i = 0; i < wf.n; i++) {
            const kiln_weight_format *e = &wf.e[i];
            if (e->format == dflt || e->format < KILN_FORMAT_F32 || e->format > KILN_FORMAT_MX8) __builtin_trap();
            if ((const char *)e->data < mem || (const char *)e->data + e->nbytes > mem + sizeof mem) __builtin_trap();
            if (i && (const char *)wf.e[i - 1].data + wf.e[i - 1].nbytes > (const char *)e->data) __builtin_trap();
            if (kiln_weight_formats_find(&wf, e->data, -1) != e->format) __builtin_trap();
        }
        if (wf.n && !any && dflt == KILN_FORMAT_F32) __builtin_trap();
    }
    kiln_free(wf.e);
    free(rules);
    return 0;
}
