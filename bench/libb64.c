/* The functions of libb64 1.2 (Debian's libb64.so.0d) that Triton's perf_analyzer binary,
 * shipped in the tritonclient wheel, links against. libb64 is not a pip package, so
 * bench/perf_analyzer.py compiles this stand-in into the virtualenv on first use. Struct
 * layouts are libb64's (perf_analyzer allocates the states itself). The encoder writes no line
 * breaks (libb64 breaks every 72 characters); perf_analyzer only decodes
 * ("b64" input data in JSON files), and decoding skips any character outside the alphabet, as
 * libb64's does. */

typedef enum { step_A, step_B, step_C } base64_encodestep;
typedef struct { base64_encodestep step; char result; int stepcount; } base64_encodestate;
typedef enum { step_a, step_b, step_c, step_d } base64_decodestep;
typedef struct { base64_decodestep step; char plainchar; } base64_decodestate;

static const char ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void base64_init_encodestate(base64_encodestate *s) { s->step = step_A; s->result = 0; s->stepcount = 0; }

char base64_encode_value(char v) { return (v < 0 || v > 63) ? '=' : ALPHABET[(int)v]; }

int base64_encode_block(const char *in, int n, char *out, base64_encodestate *s) {
    char *o = out;
    char r = s->result;
    for (int i = 0; i < n; i++) {
        unsigned char c = (unsigned char)in[i];
        switch (s->step) {
        case step_A: *o++ = base64_encode_value((char)(c >> 2)); r = (char)((c & 0x03) << 4); s->step = step_B; break;
        case step_B: *o++ = base64_encode_value((char)(r | (c >> 4))); r = (char)((c & 0x0f) << 2); s->step = step_C; break;
        case step_C: *o++ = base64_encode_value((char)(r | (c >> 6))); *o++ = base64_encode_value((char)(c & 0x3f));
                     r = 0; s->step = step_A; s->stepcount++; break;
        }
    }
    s->result = r;
    return (int)(o - out);
}

int base64_encode_blockend(char *out, base64_encodestate *s) {
    char *o = out;
    switch (s->step) {
    case step_B: *o++ = base64_encode_value(s->result); *o++ = '='; *o++ = '='; break;
    case step_C: *o++ = base64_encode_value(s->result); *o++ = '='; break;
    case step_A: break;
    }
    return (int)(o - out);
}

int base64_decode_value(char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

void base64_init_decodestate(base64_decodestate *s) { s->step = step_a; s->plainchar = 0; }

int base64_decode_block(const char *in, const int n, char *out, base64_decodestate *s) {
    char *o = out;
    for (int i = 0; i < n; i++) {
        int v = base64_decode_value(in[i]);
        if (v < 0) continue;
        switch (s->step) {
        case step_a: s->plainchar = (char)(v << 2); s->step = step_b; break;
        case step_b: *o++ = (char)(s->plainchar | (v >> 4)); s->plainchar = (char)((v & 0x0f) << 4); s->step = step_c; break;
        case step_c: *o++ = (char)(s->plainchar | (v >> 2)); s->plainchar = (char)((v & 0x03) << 6); s->step = step_d; break;
        case step_d: *o++ = (char)(s->plainchar | v); s->step = step_a; break;
        }
    }
    return (int)(o - out);
}
