/* JSON input rules shared by every reader (contract: common/bt_json.h). */
#include "common/bt_json.h"

#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

size_t bt_utf8_bom_len(const void *p, size_t n) {
    const unsigned char *b = p;
    return n >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF ? 3 : 0;
}

int bt_json_loadb(json_t **out, const void *p, size_t n, size_t flags, const char *origin) {
    *out = NULL;
    if (!origin) origin = "<json>";
    size_t bom = p ? bt_utf8_bom_len(p, n) : 0;
    json_error_t e;
    json_t *j = json_loadb(p ? (const char *)p + bom : "", p ? n - bom : 0, flags | JSON_REJECT_DUPLICATES, &e);
    if (j) {
        *out = j;
        return BT_OK;
    }
    /* jansson: "duplicate object key near '\"k\"'" (json_error_duplicate_key, jansson >= 2.11) */
    if (json_error_code(&e) == json_error_duplicate_key) {
        const char *near = strstr(e.text, "near '");
        char key[160];
        if (near) {
            near += 6;
            size_t k = strlen(near);
            if (k && near[k - 1] == '\'') k--;
            snprintf(key, sizeof key, "%.*s", (int)(k > 150 ? 150 : k), near);
        } else {
            snprintf(key, sizeof key, "(unknown)");
        }
        return bt_fail(BT_ERR_FORMAT, "%s:%d:%d: duplicate key %s (each key may appear only once in an object)",
                       origin, e.line, e.column, key);
    }
    return bt_fail(BT_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", origin, e.line, e.column, e.text);
}

int bt_json_load_file(json_t **out, const char *path, size_t flags, size_t max_bytes) {
    *out = NULL;
    char *buf = NULL;
    size_t n = 0;
    int rc = bt_read_file(path, max_bytes, &buf, &n);
    if (rc) return rc;
    rc = bt_json_loadb(out, buf, n, flags, path);
    free(buf);
    return rc;
}
