/*
 * format_rules.h -- formats per weight: `--format mx8,output=mx16,blk.0-3.ffn_down=f32` resolved
 * against a model's weights into the table a backend reads (ops.h kiln_weight_formats).
 *
 * The user writes DEFAULT[,SELECTOR=FORMAT]... (kiln.h kiln_context_params.format and
 * format_rules): the format of every product, then rules read left to right, the last rule
 * that matches a weight giving its format (general first, then specific).
 * FORMAT is f32, mx16 or mx8. SELECTOR names weight matrices by their GGUF role, whatever the
 * file the model came from:
 *   ROLE                every layer's (attn_v, ffn_down, ...), or a per-model one (output: the
 *                       head, the embedding's matrix when they are tied)
 *   blk.L / blk.A-B     every matrix of layer L / layers A..B (0-based, inclusive)
 *   blk.L.ROLE          that role in those layers (blk.A-B.ROLE likewise)
 * A rule that selects no matrix of the model is refused, naming the model's roles.
 * docs/ARITHMETIC.md, "Formats per weight".
 */
#ifndef KILN_MODELS_FORMAT_RULES_H
#define KILN_MODELS_FORMAT_RULES_H

#include "../ops/ops.h"
#include "arch.h"

/* Resolve rules (comma-separated SELECTOR=FORMAT; NULL or "": none), for an engine in fast mode
 * or not, on either device, for architecture a with config c over its weights refs / layer_refs (as kiln_wref_of reads them) and head (the
 * tensor the head's product takes) into *out: every matrix whose format differs from dflt,
 * sorted (kiln_weight_formats_sort). out->e is kiln_malloc'd (kiln_free; NULL when n is 0).
 * *any_exact: whether any product (dflt's included) runs in an exact format. Errors
 * (KILN_ERR_INVALID_ARG) name who, the rule and what was wrong; rules with fast are refused
 * (KILN_ERR_INVALID_ARG: formats are an auditable arithmetic). */
kiln_status kiln_format_rules_resolve(const char *rules, int dflt, int fast, const kiln_arch_desc *a,
                                      const kiln_model_config *c,
                                      const kiln_wref *refs, const kiln_wref *layer_refs, const kiln_tensor *head,
                                      const char *who, kiln_weight_formats *out, int *any_exact);

/* kiln_format_rules_resolve over model m's own weights (inference: contexts, engines). */
struct kiln_model;
kiln_status kiln_model_weight_formats(struct kiln_model *m, const char *rules, int dflt, int fast, const char *who, kiln_weight_formats *out);

#endif /* KILN_MODELS_FORMAT_RULES_H */
