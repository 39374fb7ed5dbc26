/*
 * format_rules.c -- formats per weight: a spec's rules resolved against a model's weight
 * matrices (format_rules.h; docs/ARITHMETIC.md, "Formats per weight").
 */
#include "format_rules.h"
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROLE_CHARS 48 /* a role's GGUF base name ("attn_output", "ffn_down_exps", ...) */
#define LIST_CHARS 512

static const char *const FORMAT_NAMES[] = {"f32", "mx16", "mx8"}; /* by kiln_format */

/* The kiln_format named by s[0..n), or -1. */
static int format_of(const char *s, size_t n) {
    for (int f = KILN_FORMAT_F32; f <= KILN_FORMAT_MX8; f++)
        if (strlen(FORMAT_NAMES[f]) == n && !memcmp(s, FORMAT_NAMES[f], n)) return f;
    return -1;
}

/* One rule: layers [lo, hi] (lo -1: any layer, and the per-model weights), role ("" any). */
typedef struct rule {
    const char *text;
    int len;
    int lo, hi;
    char role[ROLE_CHARS];
    int format;
    int hits;
} rule;

/* A non-negative decimal at *s, advanced past it; -1 when there is none or it is too large. */
static int parse_index(const char **s, const char *end) {
    const char *p = *s;
    long v = 0;
    if (p == end || *p < '0' || *p > '9') return -1;
    while (p < end && *p >= '0' && *p <= '9') {
        v = 10 * v + (*p++ - '0');
        if (v > 1000000) return -1;
    }
    *s = p;
    return (int)v;
}

static kiln_status parse_rule(const char *s, size_t n, const char *who, rule *r) {
    memset(r, 0, sizeof *r);
    r->text = s;
    r->len = (int)n;
    r->lo = r->hi = -1;
    const char *end = s + n, *eq = memchr(s, '=', n);
    if (!eq)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s' is not SELECTOR=FORMAT (for instance "
                          "output=mx16, blk.0-3.ffn_down=f32)", who, (int)n, s);
    r->format = format_of(eq + 1, (size_t)(end - eq - 1));
    if (r->format < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s': '%.*s' is not f32, mx16 or mx8", who, (int)n,
                          s, (int)(end - eq - 1), eq + 1);
    const char *p = s;
    if (eq - p >= 4 && !memcmp(p, "blk.", 4)) {
        p += 4;
        r->lo = r->hi = parse_index(&p, eq);
        if (r->lo >= 0 && p < eq && *p == '-') {
            p++;
            r->hi = parse_index(&p, eq);
        }
        if (r->lo < 0 || r->hi < r->lo || (p < eq && *p != '.') || (p < eq && p + 1 == eq))
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s': expected blk.L, blk.A-B (A <= B) or "
                              "blk.L.ROLE before '='", who, (int)n, s);
        if (p < eq) p++; /* the '.' before a role */
    }
    const size_t rl = (size_t)(eq - p);
    if ((r->lo < 0 && !rl) || rl >= ROLE_CHARS)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s': no role or layer before '='", who, (int)n, s);
    for (size_t i = 0; i < rl; i++)
        if (!((p[i] >= 'a' && p[i] <= 'z') || (p[i] >= '0' && p[i] <= '9') || p[i] == '_'))
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s': '%.*s' is not a role name (GGUF's: "
                              "attn_q, ffn_down, output, ...)", who, (int)n, s, (int)rl, p);
    memcpy(r->role, p, rl);
    r->role[rl] = '\0';
    return KILN_OK;
}

/* The GGUF base name of role r: "blk.%d.attn_q.weight" -> "attn_q", "output.weight" -> "output". */
static void role_base(const kiln_param_role *r, char *buf) {
    const char *g = r->gguf, *d = strstr(g, "%d.");
    if (d) g = d + 3;
    size_t n = strlen(g);
    if (n > 7 && !strcmp(g + n - 7, ".weight")) n -= 7;
    if (n >= ROLE_CHARS) n = ROLE_CHARS - 1;
    memcpy(buf, g, n);
    buf[n] = '\0';
}

typedef struct walk {
    rule *rules;
    int n_rules, dflt, any_exact;
    kiln_weight_formats *out; /* NULL: the first pass, which counts */
    int n_out;
    char roles[LIST_CHARS]; /* the model's selectable roles, for errors */
} walk;

static void note_role(walk *w, const char *base) {
    const size_t n = strlen(base), have = strlen(w->roles);
    for (const char *p = w->roles; (p = strstr(p, base)); p += n)
        if ((p == w->roles || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0')) return;
    if (have + n + 3 < LIST_CHARS) snprintf(w->roles + have, LIST_CHARS - have, "%s%s", have ? ", " : "", base);
}

/* One weight matrix t of role base (layer -1: per-model): its format by the rules. */
static void one_weight(walk *w, const kiln_tensor *t, const char *base, int layer) {
    if (!t) return;
    int f = w->dflt;
    for (int i = 0; i < w->n_rules; i++) {
        rule *r = &w->rules[i];
        if (r->lo >= 0 && (layer < r->lo || layer > r->hi)) continue;
        if (r->role[0] && strcmp(r->role, base)) continue;
        f = r->format;
        r->hits++;
    }
    if (f != KILN_FORMAT_F32) w->any_exact = 1;
    if (!w->out) note_role(w, base);
    if (f == w->dflt) return;
    if (w->out) w->out->e[w->out->n++] = (kiln_weight_format){t->data, t->nbytes, f};
    else w->n_out++;
}

static void walk_weights(walk *w, const kiln_arch_desc *a, const kiln_model_config *c, const kiln_wref *refs,
                         const kiln_wref *layer_refs, const kiln_tensor *head) {
    char base[ROLE_CHARS];
    for (int l = 0; l < c->n_layer; l++)
        for (int i = a->first_layer_role; i < a->first_layer_role + a->n_layer_roles; i++) {
            const kiln_param_role *r = &a->roles[i];
            if (kiln_role_is_vector(r)) continue;
            const kiln_wref *ref = &layer_refs[(size_t)l * (size_t)a->n_layer_roles + (size_t)(i - a->first_layer_role)];
            role_base(r, base);
            one_weight(w, ref->mat, base, l);
        }
    for (int i = 0; i < a->n_roles; i++) { /* per-model matrices: not the embedding (a lookup) */
        const kiln_param_role *r = &a->roles[i];
        if (r->per_layer || kiln_role_is_vector(r) || i == a->role_embed || i == a->role_head) continue;
        role_base(r, base);
        one_weight(w, refs[i].mat, base, -1);
    }
    role_base(&a->roles[a->role_head], base); /* the head's product, tied or not */
    one_weight(w, head, base, -1);
}

kiln_status kiln_format_rules_resolve(const char *rules, int dflt, int fast, const kiln_arch_desc *a,
                                      const kiln_model_config *c,
                                      const kiln_wref *refs, const kiln_wref *layer_refs, const kiln_tensor *head,
                                      const char *who, kiln_weight_formats *out, int *any_exact) {
    out->e = NULL;
    out->n = 0;
    *any_exact = dflt != KILN_FORMAT_F32;
    if (dflt < KILN_FORMAT_F32 || dflt > KILN_FORMAT_MX8)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: format %d is not f32 (0), mx16 (1) or mx8 (2)", who, dflt);
    if (!rules || !*rules) return KILN_OK;
    if (fast)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: formats per weight (format_rules) are an auditable arithmetic: "
                          "not with fast", who);
    int n_rules = 1;
    for (const char *p = rules; *p; p++) n_rules += *p == ',';
    walk w;
    memset(&w, 0, sizeof w);
    w.rules = kiln_calloc((size_t)n_rules, sizeof *w.rules);
    if (!w.rules) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", who);
    w.dflt = dflt;
    kiln_status st = KILN_OK;
    for (const char *p = rules; st == KILN_OK;) {
        const char *comma = strchr(p, ',');
        const size_t n = comma ? (size_t)(comma - p) : strlen(p);
        st = parse_rule(p, n, who, &w.rules[w.n_rules++]);
        if (st == KILN_OK && !strcmp(w.rules[w.n_rules - 1].role, "token_embd"))
            st = kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s': the embedding is a lookup, not a product "
                            "(its tied head, where it is one, is 'output')", who, (int)n, p);
        if (st == KILN_OK && w.rules[w.n_rules - 1].hi >= c->n_layer)
            st = kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s': the model has %d layers (blk.0-%d)", who,
                            (int)n, p, c->n_layer, c->n_layer - 1);
        if (!comma) break;
        p = comma + 1;
    }
    if (st == KILN_OK) walk_weights(&w, a, c, refs, layer_refs, head);
    for (int i = 0; st == KILN_OK && i < w.n_rules; i++)
        if (!w.rules[i].hits)
            st = kiln_error(KILN_ERR_INVALID_ARG, "%s: format rule '%.*s' selects no weight matrix of this model "
                            "(its roles: %s; layers blk.0-%d)", who, w.rules[i].len, w.rules[i].text, w.roles,
                            c->n_layer - 1);
    if (st == KILN_OK && w.n_out) {
        out->e = kiln_malloc((size_t)w.n_out * sizeof *out->e);
        if (!out->e) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", who);
    }
    if (st == KILN_OK && w.n_out) {
        for (int i = 0; i < w.n_rules; i++) w.rules[i].hits = 0;
        w.out = out;
        walk_weights(&w, a, c, refs, layer_refs, head);
        st = kiln_weight_formats_sort(out, who);
    }
    if (st == KILN_OK) *any_exact = w.any_exact;
    if (st != KILN_OK) {
        kiln_free(out->e);
        out->e = NULL;
        out->n = 0;
    }
    kiln_free(w.rules);
    return st;
}

kiln_status kiln_model_weight_formats(kiln_model *m, const char *rules, int dflt, int fast, const char *who,
                                      kiln_weight_formats *out) {
    int any_exact = 0;
    return kiln_format_rules_resolve(rules, dflt, fast, m->arch, &m->cfg, m->refs, m->layer_refs, m->lm_head, who, out,
                                     &any_exact);
}
