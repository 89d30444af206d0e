/* YAML <-> jansson trees, for configuration files written as YAML (trainer job configs:
 * trainer/config.h). Parsing is libyaml's (Debian libyaml-dev, yaml_parser_parse events); the tree
 * it yields is the one a JSON file of the same content gives, so one validator serves both.
 *
 * Contract of bt_yaml_load:
 *   - exactly one document; its root must be a mapping;
 *   - mappings -> JSON objects (keys are scalars, kept as their text; a key given twice is an
 *     error naming both lines), sequences -> arrays;
 *   - plain scalars resolve by the YAML 1.2 core schema (yaml.org/spec/1.2.2 §10.3.2): null, ~
 *     and empty -> null; true/false (any case form listed there) -> booleans; [-+]?[0-9]+, 0o..,
 *     0x.. -> integers (outside int64: error); decimal / exponent forms (1e-3, 2.5, .5) ->
 *     reals; .inf / .nan -> error (JSON has no such numbers); anything else -> string (so the
 *     YAML 1.1 words yes/no/on/off are strings, and a boolean key given "yes" is refused by the
 *     validator, naming it). Quoted, literal and folded scalars are strings. Explicit tags !!str,
 *     !!int, !!float, !!bool, !!null are honoured; other tags are an error;
 *   - anchors and aliases are expanded (an alias copies the anchored node); the expanded tree is
 *     capped at BT_YAML_MAX_NODES nodes and nesting at BT_YAML_MAX_DEPTH levels (billion-laughs
 *     and stack-depth attacks fail with a message instead of exhausting memory);
 *   - merge keys (<<) are refused with a message (YAML 1.1 only, not in the core schema).
 * Errors: BT_ERR_FORMAT with a message "<origin>:<line>:<column>: <what>" (1-based). */
#ifndef BT_YAML_JSON_H
#define BT_YAML_JSON_H
#include <jansson.h>
#include <stddef.h>

#define BT_YAML_MAX_NODES 1000000
#define BT_YAML_MAX_DEPTH 64

/* Parse len bytes of UTF-8 YAML (a UTF-8 BOM is skipped). *out: a new reference to the root
 * object. lines (may be NULL): *lines gets a new object mapping the key path of every mapping
 * entry and sequence item ("optim.lr", "data.shards[1]") to the 1-based line where it starts.
 * origin names the source in messages (a file path). */
int bt_yaml_load(const char *text, size_t len, const char *origin, json_t **out, json_t **lines);

/* Render an object as block-style YAML (2-space indent; arrays in flow style; every scalar
 * written in its JSON form, which is valid YAML 1.2 and reads back as the same value, reals
 * always with a '.' so YAML 1.1 readers such as PyYAML read them as numbers too). Keys starting
 * with '#' become comments: "#" documents the enclosing mapping (printed at its top), "#key" is
 * printed above the key that follows it; comment text is wrapped at ~96 columns. Returns a
 * malloc'd string, or NULL (out of memory, root not an object). */
char *bt_yaml_dump(const json_t *root);

#endif
