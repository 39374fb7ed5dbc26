/*
 * metrics.c -- the metrics CSV and the loss-curve PNG of `kiln train` (contract: metrics.h).
 *
 * Everything is written here without zlib or an image library: CRC-32 (a 16-entry nibble
 * table), Adler-32, a PNG encoder that stores its deflate blocks uncompressed, a raster with
 * Bresenham lines, and a 5x7 bitmap font drawn from the table below.
 */
#include "metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- checksums ------------------------------------------------------------------------- */

/* CRC-32 of the 16 nibble values (reflected polynomial 0xEDB88320): tab[i] = crc of nibble i
 * shifted through 4 rounds. Processing a byte low nibble first, then high, equals the usual
 * 256-entry table. */
static const uint32_t crc_nibble[16] = {
    0x00000000u, 0x1DB71064u, 0x3B6E20C8u, 0x26D930ACu, 0x76DC4190u, 0x6B6B51F4u,
    0x4DB26158u, 0x5005713Cu, 0xEDB88320u, 0xF00F9344u, 0xD6D6A3E8u, 0xCB61B38Cu,
    0x9B64C2B0u, 0x86D3D2D4u, 0xA00AE278u, 0xBDBDF21Cu,
};

uint32_t kiln_crc32(uint32_t crc, const void *data, size_t n) {
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc = (crc >> 4) ^ crc_nibble[(crc ^ p[i]) & 15u];
        crc = (crc >> 4) ^ crc_nibble[(crc ^ ((uint32_t)p[i] >> 4)) & 15u];
    }
    return ~crc;
}

uint32_t kiln_adler32(uint32_t adler, const void *data, size_t n) {
    const uint8_t *p = data;
    uint32_t a = adler & 0xFFFFu, b = adler >> 16;
    while (n > 0) {
        /* 5552 is the most bytes for which b cannot overflow 32 bits before the reduction */
        size_t k = n < 5552 ? n : 5552;
        n -= k;
        while (k--) {
            a += *p++;
            b += a;
        }
        a %= 65521u;
        b %= 65521u;
    }
    return (b << 16) | a;
}

/* ---- atomic file write ------------------------------------------------------------------- */

/* path gets exactly data[0..n) or stays as it was: <path>.tmp-<pid>, fsync, rename, dir fsync. */
static kiln_status write_file_atomic(const char *path, const void *data, size_t n) {
    size_t tl = strlen(path) + 32;
    char *tmp = kiln_malloc(tl);
    if (!tmp) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    snprintf(tmp, tl, "%s.tmp-%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        kiln_status st = kiln_error(KILN_ERR_IO, "%s: cannot create temporary file %s: %s", path, tmp,
                                    strerror(errno));
        kiln_free(tmp);
        return st;
    }
    kiln_status st = kiln_write_all(fd, data, n, tmp);
    if (st == KILN_OK && fsync(fd) != 0) st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && st == KILN_OK) st = kiln_error(KILN_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (st == KILN_OK && rename(tmp, path) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot rename %s over it: %s", path, tmp, strerror(errno));
    if (st != KILN_OK) {
        unlink(tmp);
        kiln_free(tmp);
        return st;
    }
    kiln_free(tmp);
    return kiln_fsync_parent_dir(path);
}

/* ---- PNG --------------------------------------------------------------------------------- */

static uint8_t *put_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
    return p + 4;
}

/* A chunk whose data (len bytes) is already at p + 8: write length and type before it and
 * the CRC of type + data after it. Returns the end of the chunk. */
static uint8_t *finish_chunk(uint8_t *p, const char type[4], uint32_t len) {
    put_be32(p, len);
    memcpy(p + 4, type, 4);
    uint32_t crc = kiln_crc32(0, p + 4, (size_t)len + 4);
    return put_be32(p + 8 + len, crc);
}

#define STORED_MAX 65535u

kiln_status kiln_png_write_rgb(const char *path, const uint8_t *rgb, int width, int height) {
    if (!path || !rgb) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_png_write_rgb: NULL argument");
    if (width < 1 || height < 1 || width > 32768 || height > 32768)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: image size %dx%d outside 1..32768", path, width, height);
    /* raw scanlines: filter byte 0 then 3*width bytes; at most 32768*(1+98304) < 2^32 */
    size_t row = 1 + 3 * (size_t)width, raw = row * (size_t)height;
    size_t n_blocks = (raw + STORED_MAX - 1) / STORED_MAX;
    size_t zlen = 2 + raw + 5 * n_blocks + 4; /* zlib header, blocks (5-byte headers), adler */
    if (zlen > 0x7FFFFFFFu)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: image %dx%d too large for one IDAT chunk", path, width, height);
    size_t total = 8 + (12 + 13) + (12 + zlen) + 12;
    uint8_t *buf = kiln_malloc(total);
    if (!buf) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for a %zu-byte PNG", path, total);

    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
    uint8_t *p = buf;
    memcpy(p, sig, 8);
    p += 8;
    uint8_t *d = p + 8; /* IHDR */
    d = put_be32(d, (uint32_t)width);
    d = put_be32(d, (uint32_t)height);
    *d++ = 8; /* bit depth */
    *d++ = 2; /* colour type: RGB */
    *d++ = 0; /* compression: deflate */
    *d++ = 0; /* filter method 0 */
    *d++ = 0; /* no interlace */
    p = finish_chunk(p, "IHDR", 13);

    uint8_t *z = p + 8; /* IDAT: the zlib stream */
    uint8_t *z0 = z;
    *z++ = 0x78; /* CM 8 (deflate), CINFO 7 (32K window) */
    *z++ = 0x01; /* FCHECK: 0x7801 % 31 == 0; FDICT 0; FLEVEL 0 */
    uint32_t adler = 1;
    size_t left = raw, r = 0, c = 0; /* position in the raw stream: row r, byte c of that row */
    while (left > 0) {
        uint32_t n = left > STORED_MAX ? STORED_MAX : (uint32_t)left;
        left -= n;
        *z++ = left == 0 ? 1 : 0; /* BFINAL, BTYPE 00 (stored); the rest of the byte is padding */
        *z++ = (uint8_t)n;
        *z++ = (uint8_t)(n >> 8);
        *z++ = (uint8_t)~n;
        *z++ = (uint8_t)(~n >> 8);
        uint8_t *blk = z;
        for (uint32_t k = 0; k < n;) {
            if (c == 0) {
                *z++ = 0; /* filter type None */
                c = 1;
                k++;
                continue;
            }
            size_t take = row - c < (size_t)(n - k) ? row - c : (size_t)(n - k);
            memcpy(z, rgb + r * 3 * (size_t)width + (c - 1), take);
            z += take;
            k += (uint32_t)take;
            c += take;
            if (c == row) {
                c = 0;
                r++;
            }
        }
        adler = kiln_adler32(adler, blk, n);
    }
    z = put_be32(z, adler);
    p = finish_chunk(p, "IDAT", (uint32_t)(z - z0));
    p = finish_chunk(p, "IEND", 0);

    kiln_status st = write_file_atomic(path, buf, (size_t)(p - buf));
    kiln_free(buf);
    return st;
}

/* ---- the 5x7 font ------------------------------------------------------------------------ */

/* Printable ASCII, 5 columns x 7 rows, '#' = ink. Descenders (g, j, p, q, y) stay inside the
 * 7 rows, raised by one. */
typedef struct glyph {
    char c;
    const char *rows[7];
} glyph;

static const glyph FONT[] = {
    {' ', {".....", ".....", ".....", ".....", ".....", ".....", "....."}},
    {'!', {"..#..", "..#..", "..#..", "..#..", "..#..", ".....", "..#.."}},
    {'"', {".#.#.", ".#.#.", ".#.#.", ".....", ".....", ".....", "....."}},
    {'#', {".#.#.", ".#.#.", "#####", ".#.#.", "#####", ".#.#.", ".#.#."}},
    {'$', {"..#..", ".####", "#.#..", ".###.", "..#.#", "####.", "..#.."}},
    {'%', {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"}},
    {'&', {".##..", "#..#.", "#.#..", ".#...", "#.#.#", "#..#.", ".##.#"}},
    {'\'', {"..#..", "..#..", ".#...", ".....", ".....", ".....", "....."}},
    {'(', {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."}},
    {')', {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."}},
    {'*', {".....", "..#..", "#.#.#", ".###.", "#.#.#", "..#..", "....."}},
    {'+', {".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."}},
    {',', {".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."}},
    {'-', {".....", ".....", ".....", "#####", ".....", ".....", "....."}},
    {'.', {".....", ".....", ".....", ".....", ".....", ".##..", ".##.."}},
    {'/', {".....", "....#", "...#.", "..#..", ".#...", "#....", "....."}},
    {'0', {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."}},
    {'1', {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."}},
    {'2', {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"}},
    {'3', {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."}},
    {'4', {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."}},
    {'5', {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."}},
    {'6', {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."}},
    {'7', {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."}},
    {'8', {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."}},
    {'9', {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."}},
    {':', {".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."}},
    {';', {".....", ".##..", ".##..", ".....", ".##..", "..#..", ".#..."}},
    {'<', {"...#.", "..#..", ".#...", "#....", ".#...", "..#..", "...#."}},
    {'=', {".....", ".....", "#####", ".....", "#####", ".....", "....."}},
    {'>', {".#...", "..#..", "...#.", "....#", "...#.", "..#..", ".#..."}},
    {'?', {".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."}},
    {'@', {".###.", "#...#", "....#", ".##.#", "#.#.#", "#.#.#", ".###."}},
    {'A', {".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"}},
    {'B', {"####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."}},
    {'C', {".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."}},
    {'D', {"###..", "#..#.", "#...#", "#...#", "#...#", "#..#.", "###.."}},
    {'E', {"#####", "#....", "#....", "####.", "#....", "#....", "#####"}},
    {'F', {"#####", "#....", "#....", "####.", "#....", "#....", "#...."}},
    {'G', {".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"}},
    {'H', {"#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"}},
    {'I', {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."}},
    {'J', {"..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."}},
    {'K', {"#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"}},
    {'L', {"#....", "#....", "#....", "#....", "#....", "#....", "#####"}},
    {'M', {"#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"}},
    {'N', {"#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"}},
    {'O', {".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."}},
    {'P', {"####.", "#...#", "#...#", "####.", "#....", "#....", "#...."}},
    {'Q', {".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"}},
    {'R', {"####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"}},
    {'S', {".####", "#....", "#....", ".###.", "....#", "....#", "####."}},
    {'T', {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."}},
    {'U', {"#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."}},
    {'V', {"#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."}},
    {'W', {"#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."}},
    {'X', {"#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"}},
    {'Y', {"#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."}},
    {'Z', {"#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"}},
    {'[', {".###.", ".#...", ".#...", ".#...", ".#...", ".#...", ".###."}},
    {'\\', {".....", "#....", ".#...", "..#..", "...#.", "....#", "....."}},
    {']', {".###.", "...#.", "...#.", "...#.", "...#.", "...#.", ".###."}},
    {'^', {"..#..", ".#.#.", "#...#", ".....", ".....", ".....", "....."}},
    {'_', {".....", ".....", ".....", ".....", ".....", ".....", "#####"}},
    {'`', {".#...", "..#..", "...#.", ".....", ".....", ".....", "....."}},
    {'a', {".....", ".....", ".###.", "....#", ".####", "#...#", ".####"}},
    {'b', {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "####."}},
    {'c', {".....", ".....", ".###.", "#....", "#....", "#...#", ".###."}},
    {'d', {"....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"}},
    {'e', {".....", ".....", ".###.", "#...#", "#####", "#....", ".###."}},
    {'f', {"..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."}},
    {'g', {".....", ".####", "#...#", "#...#", ".####", "....#", ".###."}},
    {'h', {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"}},
    {'i', {"..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."}},
    {'j', {"...#.", ".....", "..##.", "...#.", "...#.", "#..#.", ".##.."}},
    {'k', {"#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."}},
    {'l', {".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."}},
    {'m', {".....", ".....", "##.#.", "#.#.#", "#.#.#", "#...#", "#...#"}},
    {'n', {".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"}},
    {'o', {".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."}},
    {'p', {".....", ".....", "####.", "#...#", "####.", "#....", "#...."}},
    {'q', {".....", ".....", ".##.#", "#..##", ".####", "....#", "....#"}},
    {'r', {".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."}},
    {'s', {".....", ".....", ".###.", "#....", ".###.", "....#", "####."}},
    {'t', {".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."}},
    {'u', {".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"}},
    {'v', {".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."}},
    {'w', {".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#."}},
    {'x', {".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"}},
    {'y', {".....", ".....", "#...#", "#...#", ".####", "....#", ".###."}},
    {'z', {".....", ".....", "#####", "...#.", "..#..", ".#...", "#####"}},
    {'{', {"...#.", "..#..", "..#..", ".#...", "..#..", "..#..", "...#."}},
    {'|', {"..#..", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."}},
    {'}', {".#...", "..#..", "..#..", "...#.", "..#..", "..#..", ".#..."}},
    {'~', {".....", ".....", ".#...", "#.#.#", "...#.", ".....", "....."}},
};

static const glyph *find_glyph(char ch) {
    for (size_t i = 0; i < sizeof FONT / sizeof FONT[0]; i++)
        if (FONT[i].c == ch) return &FONT[i];
    return find_glyph('?');
}

/* ---- raster ------------------------------------------------------------------------------ */

typedef struct raster {
    uint8_t *px; /* (h, w, 3) */
    int w, h;
    int cx0, cy0, cx1, cy1; /* clip rectangle, inclusive */
} raster;

#define COL_BG 0xFFFFFFu
#define COL_FRAME 0x333333u
#define COL_GRID 0xE4E4E4u
#define COL_TEXT 0x222222u
#define COL_LEGEND_EDGE 0xBBBBBBu

static void put(raster *r, int x, int y, uint32_t col) {
    if (x < r->cx0 || x > r->cx1 || y < r->cy0 || y > r->cy1) return;
    uint8_t *p = r->px + ((size_t)y * (size_t)r->w + (size_t)x) * 3;
    p[0] = (uint8_t)(col >> 16);
    p[1] = (uint8_t)(col >> 8);
    p[2] = (uint8_t)col;
}

static void clip_all(raster *r) {
    r->cx0 = 0;
    r->cy0 = 0;
    r->cx1 = r->w - 1;
    r->cy1 = r->h - 1;
}

static void fill_rect(raster *r, int x0, int y0, int x1, int y1, uint32_t col) {
    for (int y = y0; y <= y1; y++)
        for (int x = x0; x <= x1; x++) put(r, x, y, col);
}

/* Bresenham from (x0,y0) to (x1,y1), each point stamped as a t x t square. */
static void draw_line(raster *r, int x0, int y0, int x1, int y1, int t, uint32_t col) {
    int dx = abs(x1 - x0), dy = -abs(y1 - y0);
    int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, err = dx + dy;
    int lo = -(t - 1) / 2, hi = t / 2;
    for (;;) {
        fill_rect(r, x0 + lo, y0 + lo, x0 + hi, y0 + hi, col);
        if (x0 == x1 && y0 == y1) break;
        int e2 = 2 * err;
        if (e2 >= dy) {
            err += dy;
            x0 += sx;
        }
        if (e2 <= dx) {
            err += dx;
            y0 += sy;
        }
    }
}

/* Text with its top-left corner at (x, y); each font pixel a scale x scale square. */
static void draw_text(raster *r, int x, int y, const char *s, int scale, uint32_t col) {
    for (; *s; s++, x += 6 * scale) {
        char ch = (*s >= 32 && *s <= 126) ? *s : '?';
        const glyph *g = find_glyph(ch);
        for (int gy = 0; gy < 7; gy++)
            for (int gx = 0; gx < 5; gx++)
                if (g->rows[gy][gx] == '#')
                    fill_rect(r, x + gx * scale, y + gy * scale, x + gx * scale + scale - 1,
                              y + gy * scale + scale - 1, col);
    }
}

/* Text rotated 90 degrees counter-clockwise (reading upwards), its baseline on the right:
 * the glyph box of character i covers x .. x+7*scale-1, y-(i+1)*6*scale+1 .. y-i*6*scale. */
static void draw_text_up(raster *r, int x, int y, const char *s, int scale, uint32_t col) {
    for (; *s; s++, y -= 6 * scale) {
        char ch = (*s >= 32 && *s <= 126) ? *s : '?';
        const glyph *g = find_glyph(ch);
        for (int gy = 0; gy < 7; gy++)
            for (int gx = 0; gx < 5; gx++)
                if (g->rows[gy][gx] == '#') {
                    int px = x + gy * scale, py = y - gx * scale;
                    fill_rect(r, px, py - scale + 1, px + scale - 1, py, col);
                }
    }
}

static int text_width(const char *s, int scale) {
    size_t n = strlen(s);
    return n ? (int)n * 6 * scale - scale : 0;
}

/* ---- axes -------------------------------------------------------------------------------- */

typedef struct axis {
    double lo, hi;   /* data range mapped onto the plot */
    double step;     /* tick spacing (1, 2 or 5 times a power of ten) */
    long long k0, k1; /* ticks are k*step for k in k0..k1 */
    int decimals;    /* fixed-point decimals of the labels, or -1 for %g */
} axis;

static double nice_step(double span, int target) {
    double raw = span / (target < 1 ? 1 : target);
    double mag = pow(10.0, floor(log10(raw)));
    double f = raw / mag;
    double m = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
    return m * mag;
}

static void axis_init(axis *a, double lo, double hi, int target) {
    a->lo = lo;
    a->hi = hi;
    a->step = nice_step(hi - lo, target);
    a->k0 = (long long)ceil(lo / a->step - 1e-9);
    a->k1 = (long long)floor(hi / a->step + 1e-9);
    double big = fmax(fabs(lo), fabs(hi));
    if (big >= 1e7 || a->step < 1e-5) {
        a->decimals = -1;
    } else {
        int d = (int)-floor(log10(a->step) + 1e-9);
        a->decimals = d < 0 ? 0 : d;
    }
}

static void axis_label(const axis *a, long long k, char *buf, size_t cap) {
    double v = (double)k * a->step;
    if (fabs(v) < a->step * 1e-6) v = 0.0; /* no "-0" */
    if (a->decimals < 0)
        snprintf(buf, cap, "%.3g", v);
    else
        snprintf(buf, cap, "%.*f", a->decimals, v);
}

/* ---- the plot ---------------------------------------------------------------------------- */

#define PLOT_MAX_SERIES 16

static int finite_point(const kiln_plot_series *s, size_t i) {
    return isfinite(s->x[i]) && isfinite(s->y[i]);
}

kiln_status kiln_plot_write_png(const char *path, int width, int height, const char *title,
                                const kiln_plot_series *series, size_t n_series) {
    if (!path || (n_series && !series)) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_plot_write_png: NULL argument");
    if (width < 160 || height < 120 || width > 8192 || height > 8192)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: plot size %dx%d outside 160x120..8192x8192", path, width,
                          height);
    if (n_series > PLOT_MAX_SERIES)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: %zu series, at most %d", path, n_series, PLOT_MAX_SERIES);
    size_t n_finite[PLOT_MAX_SERIES] = {0};
    double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
    for (size_t s = 0; s < n_series; s++) {
        if (series[s].n && (!series[s].x || !series[s].y))
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: series %zu has NULL x or y", path, s);
        for (size_t i = 0; i < series[s].n; i++) {
            if (!finite_point(&series[s], i)) continue;
            n_finite[s]++;
            xmin = fmin(xmin, series[s].x[i]);
            xmax = fmax(xmax, series[s].x[i]);
            ymin = fmin(ymin, series[s].y[i]);
            ymax = fmax(ymax, series[s].y[i]);
        }
    }
    if (!(xmin <= xmax)) { /* no finite point */
        xmin = 0;
        xmax = 1;
        ymin = 0;
        ymax = 1;
    }
    /* steps counted from 1 (or a few): start the axis at 0, where training started */
    if (xmin > 0 && xmin <= 0.05 * (xmax - xmin)) xmin = 0;
    if (!(xmax - xmin > fabs(xmin) * 1e-12)) { /* one x value: centre it */
        xmin -= 1;
        xmax += 1;
    }
    if (!(ymax - ymin > fabs(ymin) * 1e-12)) { /* flat curve: +-10% around it */
        double d = ymin != 0 ? fabs(ymin) * 0.1 : 1.0;
        ymin -= d;
        ymax += d;
    } else {
        double pad = 0.05 * (ymax - ymin);
        ymin -= pad;
        ymax += pad;
    }

    size_t npx;
    if (kiln_mul_overflow((size_t)width * (size_t)height, 3, &npx))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: plot size overflows", path);
    raster r = {.px = kiln_malloc(npx), .w = width, .h = height};
    if (!r.px) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for a %dx%d plot", path, width, height);
    memset(r.px, 0xFF, npx); /* COL_BG */
    clip_all(&r);

    /* text scale: 5x7 glyphs doubled from about 640x400 up */
    int ts = width / 320 < height / 200 ? width / 320 : height / 200;
    if (ts < 1) ts = 1;
    if (ts > 4) ts = 4;
    int lw = ts; /* curve thickness */
    int gap = 4 * ts, th = 7 * ts;

    /* the plot rectangle, from the room the labels need */
    int top = title && *title ? gap * 2 + th + gap : gap * 3;
    /* below the frame: tick marks, tick labels, then "step" */
    int bottom = height - 1 - (2 * ts + gap + th + 2 * gap + th + gap);
    int right = width - 1 - 6 * gap;
    /* y ticks first (they depend only on the height), their labels set the left margin */
    axis ya, xa;
    axis_init(&ya, ymin, ymax, (bottom - top) / (18 * ts) < 2 ? 2 : (bottom - top) / (18 * ts));
    int ylab_w = 0;
    char lab[64];
    for (long long k = ya.k0; k <= ya.k1; k++) {
        axis_label(&ya, k, lab, sizeof lab);
        int tw = text_width(lab, ts);
        if (tw > ylab_w) ylab_w = tw;
    }
    int left = gap + th + gap + ylab_w + gap + 2 * ts;
    if (left > width / 2) left = width / 2;
    axis_init(&xa, xmin, xmax, (right - left) / (45 * ts) < 2 ? 2 : (right - left) / (45 * ts));
    if (bottom - top < 20 || right - left < 20) {
        kiln_free(r.px);
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: %dx%d leaves no room for the plot area", path, width, height);
    }
    double sx = (right - left) / (xa.hi - xa.lo), sy = (bottom - top) / (ya.hi - ya.lo);
#define MAPX(v) ((int)lround(left + ((v) - xa.lo) * sx))
#define MAPY(v) ((int)lround(bottom - ((v) - ya.lo) * sy))

    /* grid, ticks and labels */
    for (long long k = ya.k0; k <= ya.k1; k++) {
        int y = MAPY((double)k * ya.step);
        if (y < top || y > bottom) continue;
        fill_rect(&r, left + 1, y, right - 1, y, COL_GRID);
        fill_rect(&r, left - 2 * ts, y, left - 1, y, COL_FRAME);
        axis_label(&ya, k, lab, sizeof lab);
        draw_text(&r, left - 2 * ts - gap - text_width(lab, ts), y - th / 2, lab, ts, COL_TEXT);
    }
    for (long long k = xa.k0; k <= xa.k1; k++) {
        int x = MAPX((double)k * xa.step);
        if (x < left || x > right) continue;
        fill_rect(&r, x, top + 1, x, bottom - 1, COL_GRID);
        fill_rect(&r, x, bottom + 1, x, bottom + 2 * ts, COL_FRAME);
        axis_label(&xa, k, lab, sizeof lab);
        int tw = text_width(lab, ts), lx = x - tw / 2;
        if (lx + tw > width - 2) lx = width - 2 - tw;
        draw_text(&r, lx, bottom + 2 * ts + gap, lab, ts, COL_TEXT);
    }
    /* axis titles and the title */
    draw_text(&r, left + (right - left - text_width("step", ts)) / 2, height - 1 - gap - th, "step", ts, COL_TEXT);
    draw_text_up(&r, gap, top + (bottom - top + text_width("loss", ts)) / 2, "loss", ts, COL_TEXT);
    if (title && *title) {
        /* a title wider than the image is cut, ending in "..." */
        char tbuf[256];
        size_t fit = (size_t)((width - 2 * gap + ts) / (6 * ts)), tl = strlen(title);
        if (fit > sizeof tbuf - 1) fit = sizeof tbuf - 1;
        if (tl > fit) {
            memcpy(tbuf, title, fit);
            if (fit >= 3) memcpy(tbuf + fit - 3, "...", 3);
            tl = fit;
        } else {
            memcpy(tbuf, title, tl);
        }
        tbuf[tl] = 0;
        int tw = text_width(tbuf, ts);
        int tx = left + (right - left - tw) / 2;
        if (tx + tw > width - gap) tx = width - gap - tw;
        if (tx < gap) tx = gap;
        draw_text(&r, tx, gap * 2, tbuf, ts, COL_TEXT);
    }

    /* the curves, clipped to the inside of the frame */
    r.cx0 = left + 1;
    r.cy0 = top + 1;
    r.cx1 = right - 1;
    r.cy1 = bottom - 1;
    for (size_t s = 0; s < n_series; s++) {
        const kiln_plot_series *se = &series[s];
        int have = 0, px = 0, py = 0;
        int markers = n_finite[s] > 0 && n_finite[s] * 10 <= (size_t)(right - left);
        for (size_t i = 0; i < se->n; i++) {
            if (!finite_point(se, i)) continue;
            int x = MAPX(se->x[i]), y = MAPY(se->y[i]);
            if (have) draw_line(&r, px, py, x, y, lw, se->color);
            if (markers) fill_rect(&r, x - 2 * lw, y - 2 * lw, x + 2 * lw, y + 2 * lw, se->color);
            px = x;
            py = y;
            have = 1;
        }
    }
    clip_all(&r);
    size_t any = 0;
    for (size_t s = 0; s < n_series; s++) any += n_finite[s];
    if (!any)
        draw_text(&r, left + (right - left - text_width("no data", ts)) / 2, top + (bottom - top - th) / 2,
                  "no data", ts, COL_TEXT);
    /* the frame on top of the curves' ends */
    fill_rect(&r, left, top, right, top, COL_FRAME);
    fill_rect(&r, left, bottom, right, bottom, COL_FRAME);
    fill_rect(&r, left, top, left, bottom, COL_FRAME);
    fill_rect(&r, right, top, right, bottom, COL_FRAME);

    /* legend: top right inside the plot, one row per named series that has a point */
    int n_leg = 0, name_w = 0;
    for (size_t s = 0; s < n_series; s++)
        if (series[s].name && *series[s].name && n_finite[s]) {
            n_leg++;
            int tw = text_width(series[s].name, ts);
            if (tw > name_w) name_w = tw;
        }
    if (n_leg) {
        int sample = 8 * gap, row_h = th + gap;
        int bw = gap + sample + gap + name_w + gap, bh = gap + n_leg * row_h;
        int bx1 = right - 2 * gap, bx0 = bx1 - bw, by0 = top + 2 * gap, by1 = by0 + bh;
        fill_rect(&r, bx0, by0, bx1, by1, COL_BG);
        fill_rect(&r, bx0, by0, bx1, by0, COL_LEGEND_EDGE);
        fill_rect(&r, bx0, by1, bx1, by1, COL_LEGEND_EDGE);
        fill_rect(&r, bx0, by0, bx0, by1, COL_LEGEND_EDGE);
        fill_rect(&r, bx1, by0, bx1, by1, COL_LEGEND_EDGE);
        int row = 0;
        for (size_t s = 0; s < n_series; s++) {
            if (!(series[s].name && *series[s].name && n_finite[s])) continue;
            int ty = by0 + gap + row * row_h, cy = ty + th / 2;
            draw_line(&r, bx0 + gap, cy, bx0 + gap + sample, cy, lw + 1, series[s].color);
            draw_text(&r, bx0 + gap + sample + gap, ty, series[s].name, ts, COL_TEXT);
            row++;
        }
    }
#undef MAPX
#undef MAPY

    kiln_status st = kiln_png_write_rgb(path, r.px, width, height);
    kiln_free(r.px);
    return st;
}

/* ---- metrics CSV ------------------------------------------------------------------------- */

#define METRICS_NCOLS 7
#define METRICS_MAX_FILE ((size_t)1 << 31)

struct kiln_metrics {
    int fd;
    char *path;
};

kiln_metrics_values kiln_metrics_values_empty(void) {
    kiln_metrics_values v = {0, NAN, NAN, NAN, NAN, NAN, NAN};
    return v;
}

/* The shortest of %.15g / %.17g that strtod reads back to v; "" for NaN. */
static void format_cell(char *buf, size_t cap, double v) {
    if (isnan(v)) {
        buf[0] = 0;
        return;
    }
    snprintf(buf, cap, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, cap, "%.17g", v);
}

static kiln_status metrics_new(const char *path, int fd, kiln_metrics **out) {
    kiln_metrics *m = kiln_calloc(1, sizeof *m);
    char *p = kiln_strdup(path);
    if (!m || !p) {
        kiln_free(m);
        kiln_free(p);
        close(fd);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    m->fd = fd;
    m->path = p;
    *out = m;
    return KILN_OK;
}

kiln_status kiln_metrics_open(const char *path, kiln_metrics **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_metrics_open: NULL argument");
    *out = NULL;
    int fd;
    kiln_status st0 = kiln_open_file(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644, 0, &fd);
    if (st0 != KILN_OK) return kiln_error_prefix(st0, "metrics CSV");
    kiln_status st = kiln_write_all(fd, KILN_METRICS_HEADER "\n", sizeof KILN_METRICS_HEADER, path);
    if (st != KILN_OK) {
        close(fd);
        return st;
    }
    return metrics_new(path, fd, out);
}

/* Split one line (no '\n') into its 7 cells and parse them. line_no is 1-based, for errors. */
static kiln_status parse_row(const char *path, size_t line_no, const char *s, size_t len, uint64_t *step,
                             double vals[METRICS_NCOLS - 1]) {
    static const char *const names[METRICS_NCOLS] = {"step", "loss", "eval_loss", "lr", "grad_norm",
                                                     "tokens_per_s", "elapsed_s"};
    if (len && s[len - 1] == '\r') len--;
    size_t pos = 0;
    for (int c = 0; c < METRICS_NCOLS; c++) {
        size_t end = pos;
        while (end < len && s[end] != ',') end++;
        if (c < METRICS_NCOLS - 1 && end == len)
            return kiln_error(KILN_ERR_FORMAT, "%s: line %zu: %d cells, expected %d", path, line_no, c + 1,
                              METRICS_NCOLS);
        if (c == METRICS_NCOLS - 1 && end != len)
            return kiln_error(KILN_ERR_FORMAT, "%s: line %zu: more than %d cells", path, line_no, METRICS_NCOLS);
        char cell[64];
        size_t cl = end - pos;
        if (cl >= sizeof cell)
            return kiln_error(KILN_ERR_FORMAT, "%s: line %zu: column %s: cell of %zu bytes is too long", path,
                              line_no, names[c], cl);
        memcpy(cell, s + pos, cl);
        cell[cl] = 0;
        if (c == 0) {
            int ok = cl > 0 && cl <= 20;
            for (size_t i = 0; i < cl && ok; i++) ok = cell[i] >= '0' && cell[i] <= '9';
            errno = 0;
            unsigned long long v = ok ? strtoull(cell, NULL, 10) : 0;
            if (!ok || errno == ERANGE)
                return kiln_error(KILN_ERR_FORMAT, "%s: line %zu: column step: '%s' is not an unsigned integer",
                                  path, line_no, cell);
            *step = (uint64_t)v;
        } else if (cl == 0) {
            vals[c - 1] = NAN;
        } else {
            char *e;
            double v = strtod(cell, &e);
            if (*e || e == cell || cell[0] == ' ')
                return kiln_error(KILN_ERR_FORMAT, "%s: line %zu: column %s: '%s' is not a number", path, line_no,
                                  names[c], cell);
            vals[c - 1] = v;
        }
        pos = end + 1;
    }
    return KILN_OK;
}

/* Check the header of a CSV held in buf[0..len); *body = offset just past its '\n'. */
static kiln_status check_header(const char *path, const char *buf, size_t len, size_t *body) {
    size_t hl = sizeof KILN_METRICS_HEADER - 1;
    size_t nl = 0;
    while (nl < len && buf[nl] != '\n') nl++;
    size_t l = nl;
    if (l && buf[l - 1] == '\r') l--;
    if (nl == len || l != hl || memcmp(buf, KILN_METRICS_HEADER, hl) != 0)
        return kiln_error(KILN_ERR_FORMAT, "%s: line 1: not a kiln metrics CSV (expected the header \"%s\")", path,
                          KILN_METRICS_HEADER);
    *body = nl + 1;
    return KILN_OK;
}

kiln_status kiln_metrics_open_resume(const char *path, uint64_t resume_step, kiln_metrics **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_metrics_open_resume: NULL argument");
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        if (errno == ENOENT) return kiln_metrics_open(path, out);
        return kiln_error(KILN_ERR_IO, "%s: cannot stat metrics CSV: %s", path, strerror(errno));
    }
    if (!S_ISREG(sb.st_mode)) return kiln_path_check_file(path); /* never block on a FIFO */
    if (sb.st_size == 0) return kiln_metrics_open(path, out);
    char *buf;
    size_t len;
    KILN_TRY(kiln_read_text_file(path, METRICS_MAX_FILE, &buf, &len));
    /* a header cut short by a crash while it was being written: start over */
    size_t hl = sizeof KILN_METRICS_HEADER;
    if (len < hl && memcmp(buf, KILN_METRICS_HEADER "\n", len) == 0) {
        kiln_free(buf);
        return kiln_metrics_open(path, out);
    }
    size_t pos = 0;
    kiln_status st = check_header(path, buf, len, &pos);
    size_t cut = len, line_no = 1;
    while (st == KILN_OK && pos < len) {
        size_t end = pos;
        while (end < len && buf[end] != '\n') end++;
        line_no++;
        if (end == len) { /* partial last line */
            cut = pos;
            break;
        }
        uint64_t step;
        double vals[METRICS_NCOLS - 1];
        st = parse_row(path, line_no, buf + pos, end - pos, &step, vals);
        if (st == KILN_OK && step > resume_step) {
            cut = pos;
            break;
        }
        pos = end + 1;
    }
    kiln_free(buf);
    if (st != KILN_OK) return st;
    int fd;
    KILN_TRY(kiln_open_file(path, O_WRONLY | O_APPEND, 0, 1, &fd));
    if (cut < len && ftruncate(fd, (off_t)cut) != 0) {
        st = kiln_error(KILN_ERR_IO, "%s: cannot truncate to %zu bytes: %s", path, cut, strerror(errno));
        close(fd);
        return st;
    }
    return metrics_new(path, fd, out);
}

kiln_status kiln_metrics_row(kiln_metrics *m, const kiln_metrics_values *v) {
    if (!m || !v) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_metrics_row: NULL argument");
    if (m->fd < 0) return kiln_error(KILN_ERR_STATE, "%s: an earlier write failed", m->path);
    const double cells[METRICS_NCOLS - 1] = {v->loss, v->eval_loss, v->lr, v->grad_norm, v->tokens_per_s,
                                             v->elapsed_s};
    char line[512], cell[40];
    int n = snprintf(line, sizeof line, "%llu", (unsigned long long)v->step);
    for (int c = 0; c < METRICS_NCOLS - 1; c++) {
        format_cell(cell, sizeof cell, cells[c]);
        n += snprintf(line + n, sizeof line - (size_t)n, ",%s", cell);
    }
    line[n++] = '\n'; /* at most 20 + 6 * 25 + 1 bytes: fits */
    kiln_status st = kiln_write_all(m->fd, line, (size_t)n, m->path);
    if (st != KILN_OK) {
        /* a partial row may be on disk: refuse further rows rather than glue onto it */
        close(m->fd);
        m->fd = -1;
    }
    return st;
}

kiln_status kiln_metrics_close(kiln_metrics *m) {
    if (!m) return KILN_OK;
    kiln_status st = KILN_OK;
    if (m->fd >= 0) {
        if (fsync(m->fd) != 0) st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", m->path, strerror(errno));
        if (close(m->fd) != 0 && st == KILN_OK)
            st = kiln_error(KILN_ERR_IO, "%s: close failed: %s", m->path, strerror(errno));
    }
    kiln_free(m->path);
    kiln_free(m);
    return st;
}

void kiln_metrics_log_free(kiln_metrics_log *log) {
    if (!log) return;
    kiln_free(log->step);
    kiln_free(log->loss); /* the block holding every double column */
    memset(log, 0, sizeof *log);
}

kiln_status kiln_metrics_read(const char *path, kiln_metrics_log *out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_metrics_read: NULL argument");
    memset(out, 0, sizeof *out);
    char *buf;
    size_t len, pos = 0;
    KILN_TRY(kiln_read_text_file(path, METRICS_MAX_FILE, &buf, &len));
    kiln_status st = check_header(path, buf, len, &pos);
    if (st != KILN_OK) {
        kiln_free(buf);
        return st;
    }
    size_t rows = 0; /* complete lines after the header */
    for (size_t i = pos; i < len; i++) rows += buf[i] == '\n';
    size_t cap = rows ? rows : 1, dbytes;
    if (kiln_mul_overflow(cap, (METRICS_NCOLS - 1) * sizeof(double), &dbytes)) {
        kiln_free(buf);
        return kiln_error(KILN_ERR_NOMEM, "%s: too many rows", path);
    }
    uint64_t *steps = kiln_calloc(cap, sizeof *steps);
    double *cols = kiln_malloc(dbytes);
    if (!steps || !cols) {
        kiln_free(steps);
        kiln_free(cols);
        kiln_free(buf);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for %zu rows", path, rows);
    }
    size_t n = 0, line_no = 1;
    while (pos < len && n < rows) {
        size_t end = pos;
        while (buf[end] != '\n') end++; /* a '\n' exists: n < rows */
        line_no++;
        double vals[METRICS_NCOLS - 1];
        st = parse_row(path, line_no, buf + pos, end - pos, &steps[n], vals);
        if (st != KILN_OK) break;
        for (int c = 0; c < METRICS_NCOLS - 1; c++) cols[(size_t)c * cap + n] = vals[c];
        n++;
        pos = end + 1;
    }
    kiln_free(buf);
    if (st != KILN_OK) {
        kiln_free(steps);
        kiln_free(cols);
        return st;
    }
    out->n = n;
    out->step = steps;
    out->loss = cols;
    out->eval_loss = cols + cap;
    out->lr = cols + 2 * cap;
    out->grad_norm = cols + 3 * cap;
    out->tokens_per_s = cols + 4 * cap;
    out->elapsed_s = cols + 5 * cap;
    return KILN_OK;
}

kiln_status kiln_metrics_plot(const char *csv_path, const char *png_path, int width, int height,
                              const char *title) {
    if (!csv_path || !png_path) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_metrics_plot: NULL argument");
    kiln_metrics_log log;
    KILN_TRY(kiln_metrics_read(csv_path, &log));
    double *x = kiln_calloc(log.n ? log.n : 1, sizeof *x);
    if (!x) {
        kiln_metrics_log_free(&log);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", png_path);
    }
    for (size_t i = 0; i < log.n; i++) x[i] = (double)log.step[i];
    kiln_plot_series s[2] = {
        {"train", 0x1F77B4u, x, log.loss, log.n},
        {"eval", 0xFF7F0Eu, x, log.eval_loss, log.n},
    };
    kiln_status st = kiln_plot_write_png(png_path, width, height, title, s, 2);
    kiln_free(x);
    kiln_metrics_log_free(&log);
    return st;
}
