/* The four C23 entry points the llama-cpp-py-sync 0.11739 wheel's libraries import from
 * glibc 2.38 (version GLIBC_2.38), defined as their C99 counterparts for an older glibc.
 * The C23 variants differ only in accepting "0b" binary prefixes and binary %i input,
 * which llama.cpp does not parse. Loaded with LD_PRELOAD by tests/support/wheel_client.py. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }

int __isoc23_sscanf(const char *s, const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    int n = vsscanf(s, format, ap);
    va_end(ap);
    return n;
}
