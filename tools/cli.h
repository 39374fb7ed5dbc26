/* cli.h -- shared pieces of the kiln command-line tool (subcommands in cmd_*.c). */
#ifndef KILN_CLI_H
#define KILN_CLI_H

#include "kiln.h"

#include <stdint.h>
#include <stdio.h>

int cmd_generate(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_data(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_distill(int argc, char **argv);
int cmd_audit(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_serve(int argc, char **argv);

int cmd_fingerprint(int argc, char **argv);
int cmd_verify(int argc, char **argv);

/* A prompt's ids as `kiln generate` makes them: text tokenized with the tokenizer's special
 * tokens (BOS), or with chat the messages rendered by the model's chat template (which holds
 * its special tokens) and tokenized as they are. *ids is malloc'd. */
kiln_status cli_encode_prompt(const kiln_tokenizer *tok, const char *text, int chat, const kiln_chat_message *msgs,
                              size_t n_msgs, int32_t **ids, size_t *n_ids);

/* Print "kiln <cmd>: <what>: <kiln_last_error()>" to stderr and return 1; "<what>: " is left
 * out when the library's message already names it (a path, usually). */
int cli_fail(const char *cmd, const char *what, kiln_status st);
/* A seed for a run that was given none: 8 bytes of /dev/urandom, else time ^ pid. */
uint64_t cli_random_seed(void);

/* Print a usage error and return 2. */
int cli_usage_error(const char *cmd, const char *fmt, ...);
/* --device's value: cpu -> -1, cuda -> 0, cuda:N -> N; 0, or a usage error's exit code. */
int cli_parse_device(const char *cmd, const char *v, int *device);
/* A format spec, DEFAULT[,SELECTOR=FORMAT]... (docs/ARITHMETIC.md, "Formats per weight"),
 * into the default's kiln_format and its rules (a pointer into spec; NULL: none; a spec that
 * starts with a rule has default f32; the library checks the rules against the model). 0, or
 * -1 with *why set to a static message. */
int cli_format_spec_split(const char *spec, int *format, const char **rules, const char **why);
/* The longest format spec the CLI takes (characters): a run's settings and its checkpoint
 * record the whole spec (kiln train --resume compares it). */
#define CLI_FORMAT_SPEC_MAX 1024
/* --format's value (a format spec, under CLI_FORMAT_SPEC_MAX characters); 0, or a usage
 * error's exit code. */
int cli_parse_format(const char *cmd, const char *v, int *format, const char **rules);
/* The name of a kiln_format ("f32", "mx16", "mx8"). */
const char *cli_format_name(int format);
/* The spec of a format and its rules (NULL: none), as --format takes it, into buf. */
void cli_format_spec(int format, const char *rules, char *buf, size_t cap);

/* Parse a whole-string number; return 0 on success, else print an error naming opt. */
int cli_parse_int(const char *cmd, const char *opt, const char *s, long lo, long hi, long *out);
int cli_parse_float(const char *cmd, const char *opt, const char *s, double lo, double hi,
                    double *out);
int cli_parse_u64(const char *cmd, const char *opt, const char *s, unsigned long long *out);

/* Read a whole file (or "-" for stdin) into a NUL-terminated malloc'd buffer, refusing more
 * than max_bytes (it stops reading one byte past the limit, so an endless input such as
 * /dev/zero is refused, not slurped). On failure prints "kiln <cmd>: ..." naming the path and
 * the reason, and returns NULL. */
#define CLI_READ_MAX ((size_t)256 << 20) /* inputs that are not bounded by something tighter */
char *cli_read_file(const char *cmd, const char *path, size_t max_bytes, size_t *len);

/* The value text of "key" in a flat JSON object as a run's run.json holds it (numbers, and
 * strings without escapes) into buf (cut to cap - 1 bytes); 0 when the key is absent. */
int cli_run_value(const char *json, const char *key, char *buf, size_t cap);

/* 1 when argv[*i] equals name; then *val = argv[++*i] (error when missing). */
int cli_opt(int argc, char **argv, int *i, const char *name, const char **val, int *err,
            const char *cmd);

#endif
