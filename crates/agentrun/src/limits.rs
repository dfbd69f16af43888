//! Bounds on what one event may hold, applied to its payload before it is stored: string
//! length, nesting depth, members per array or object, and the serialized size. What is
//! cut leaves a visible marker (`…[truncated N bytes]` and the like), never silence.

use std::io;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// Event limits; the defaults suit a coding agent's tool output. All are configurable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    /// Longest string (or object key) kept whole, in bytes; longer ones keep this many
    /// bytes (cut at a character boundary) followed by `…[truncated N bytes]`.
    pub max_string_bytes: usize,
    /// Deepest nesting of arrays and objects kept (the payload's own object is level 1);
    /// a container deeper than this becomes the string `…[truncated: nested deeper than D]`.
    pub max_depth: usize,
    /// Most elements of an array (members of an object) kept; the rest are replaced by
    /// one marker element (member).
    pub max_items: usize,
    /// Largest payload, serialized, after the other limits; a larger one is replaced by
    /// `{"truncated": true, "bytes": N, "preview": "<its first bytes>"}`.
    pub max_payload_bytes: usize,
    /// Events stored per run (the store's cap, counting its final `truncated` marker).
    pub max_events_per_run: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_string_bytes: 16 * 1024,
            max_depth: 16,
            max_items: 1000,
            max_payload_bytes: 256 * 1024,
            max_events_per_run: 10_000,
        }
    }
}

/// What [`Limits::apply`] cut.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Strings and keys shortened.
    pub strings_truncated: usize,
    /// Containers replaced for being too deep.
    pub containers_cut: usize,
    /// Array elements and object members dropped.
    pub items_dropped: usize,
    /// Whether the whole payload was replaced for its size.
    pub payload_replaced: bool,
}

impl Applied {
    /// Whether anything was cut.
    pub fn any(&self) -> bool {
        *self != Applied::default()
    }
}

/// Key of the marker member that stands for an object's dropped members.
const DROPPED_MEMBERS_KEY: &str = "…[truncated]";

/// Shortens `s` to at most `max_bytes` bytes of its content (at a character boundary) and
/// appends `…[truncated N bytes]`, N being the bytes cut; `false` if it was short enough.
pub fn truncate_string(s: &mut String, max_bytes: usize) -> bool {
    if s.len() <= max_bytes {
        return false;
    }
    let mut cut = max_bytes;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    let removed = s.len() - cut;
    s.truncate(cut);
    s.push_str(&format!("…[truncated {removed} bytes]"));
    true
}

/// Counts bytes written, to size a payload without building its text.
struct Counter(usize);

impl io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn serialized_len(v: &Value) -> usize {
    let mut counter = Counter(0);
    // Writing a Value into a counter cannot fail: it has only string keys and no I/O.
    match serde_json::to_writer(&mut counter, v) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

/// Drops a value without recursion: serde_json's own drop recurses once per level.
pub(crate) fn drop_flat(value: Value) {
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => stack.extend(map.into_iter().map(|(_, v)| v)),
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
        }
    }
}

impl Limits {
    /// The per-run cap as the store takes it.
    pub fn max_events(&self) -> i64 {
        i64::try_from(self.max_events_per_run).unwrap_or(i64::MAX)
    }

    /// Applies every limit to `payload` in place and says what was cut. It walks the value
    /// with its own stack, so no depth of input can exhaust the thread's.
    pub fn apply(&self, payload: &mut Value) -> Applied {
        let mut applied = Applied::default();
        let mut stack: Vec<(&mut Value, usize)> = vec![(payload, 0)];
        while let Some((value, depth)) = stack.pop() {
            let container = value.is_array() || value.is_object();
            if container && depth >= self.max_depth {
                let cut = std::mem::replace(
                    value,
                    Value::String(format!(
                        "…[truncated: nested deeper than {}]",
                        self.max_depth
                    )),
                );
                drop_flat(cut);
                applied.containers_cut += 1;
                continue;
            }
            match value {
                Value::String(s) => {
                    if truncate_string(s, self.max_string_bytes) {
                        applied.strings_truncated += 1;
                    }
                }
                Value::Array(items) => {
                    let mut kept = items.len();
                    if items.len() > self.max_items {
                        let dropped = items.len() - self.max_items;
                        for cut in items.drain(self.max_items..) {
                            drop_flat(cut);
                        }
                        items.push(Value::String(format!("…[truncated {dropped} items]")));
                        applied.items_dropped += dropped;
                        kept = self.max_items;
                    }
                    // The marker itself is not subject to the limits.
                    for item in items.iter_mut().take(kept) {
                        stack.push((item, depth + 1));
                    }
                }
                Value::Object(map) => {
                    self.limit_object(map, &mut applied);
                    for (key, child) in map.iter_mut() {
                        if key != DROPPED_MEMBERS_KEY {
                            stack.push((child, depth + 1));
                        }
                    }
                }
                Value::Null | Value::Bool(_) | Value::Number(_) => {}
            }
        }
        let bytes = serialized_len(payload);
        if bytes > self.max_payload_bytes {
            let mut preview = serde_json::to_string(payload).unwrap_or_default();
            let keep = self.max_string_bytes.min(self.max_payload_bytes / 2);
            truncate_string(&mut preview, keep);
            *payload = json!({ "truncated": true, "bytes": bytes, "preview": preview });
            applied.payload_replaced = true;
        }
        applied
    }

    /// Drops members past `max_items` and shortens long keys of one object.
    fn limit_object(&self, map: &mut Map<String, Value>, applied: &mut Applied) {
        let mut dropped = 0;
        if map.len() > self.max_items {
            let extra: Vec<String> = map.keys().skip(self.max_items).cloned().collect();
            for key in &extra {
                if let Some(v) = map.remove(key) {
                    drop_flat(v);
                }
            }
            dropped = extra.len();
            applied.items_dropped += dropped;
        }
        let long: Vec<String> = map
            .keys()
            .filter(|k| k.len() > self.max_string_bytes)
            .cloned()
            .collect();
        for key in long {
            if let Some(v) = map.remove(&key) {
                let mut short = key;
                truncate_string(&mut short, self.max_string_bytes);
                map.insert(short, v);
                applied.strings_truncated += 1;
            }
        }
        // Added last, so neither the member count nor the key length cut it.
        if dropped > 0 {
            map.insert(
                DROPPED_MEMBERS_KEY.to_string(),
                Value::String(format!("{dropped} members")),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Limits {
        Limits {
            max_string_bytes: 8,
            max_depth: 3,
            max_items: 3,
            max_payload_bytes: 10_000,
            max_events_per_run: 5,
        }
    }

    #[test]
    fn long_strings_keep_their_head_and_say_how_much_went() {
        let mut s = "0123456789abcdef".to_string();
        assert!(truncate_string(&mut s, 10));
        assert_eq!(s, "0123456789…[truncated 6 bytes]");
        let mut short = "short".to_string();
        assert!(!truncate_string(&mut short, 5));
        assert_eq!(short, "short");
        // Never inside a character: "é" is two bytes, so the cut moves back.
        let mut accented = "aéééé".to_string();
        assert!(truncate_string(&mut accented, 2));
        assert_eq!(accented, "a…[truncated 8 bytes]");
    }

    #[test]
    fn strings_at_any_depth_and_in_arrays_are_cut() {
        let mut v = json!({"a": "0123456789", "b": [{"c": "abcdefghijk"}], "d": 12345678901i64});
        let applied = small().apply(&mut v);
        assert_eq!(applied.strings_truncated, 2);
        assert_eq!(
            v,
            json!({"a": "01234567…[truncated 2 bytes]", "b": [{"c": "abcdefgh…[truncated 3 bytes]"}], "d": 12345678901i64})
        );
    }

    #[test]
    fn containers_below_the_depth_limit_are_replaced() {
        // The payload's object is level 1, so with a limit of 3 the objects under `l2` and
        // `l3` stay and the one under `l4` (level 4) goes, as does `[2]`.
        let mut v = json!({"l2": {"l3": {"l4": {"l5": 1}}, "ok": [1, [2]]}});
        let applied = small().apply(&mut v);
        assert_eq!(applied.containers_cut, 2);
        assert_eq!(
            v,
            json!({"l2": {"l3": {"l4": "…[truncated: nested deeper than 3]"}, "ok": [1, "…[truncated: nested deeper than 3]"]}})
        );
        // With a limit of 0 not even the payload's own object stays.
        let mut v = json!({"a": 1});
        let zero = Limits {
            max_depth: 0,
            ..Limits::default()
        };
        zero.apply(&mut v);
        assert_eq!(v, json!("…[truncated: nested deeper than 0]"));
    }

    #[test]
    fn a_very_deep_value_does_not_overflow_the_stack() {
        let mut v = json!(1);
        for _ in 0..100_000 {
            v = Value::Array(vec![v]);
        }
        let applied = Limits::default().apply(&mut v);
        assert_eq!(applied.containers_cut, 1);
        let mut depth = 0;
        let mut at = &v;
        while let Value::Array(items) = at {
            depth += 1;
            at = &items[0];
        }
        assert_eq!(depth, 16);
        assert!(at.as_str().unwrap().starts_with("…[truncated: nested"));
    }

    #[test]
    fn long_arrays_and_objects_keep_their_first_members() {
        let mut v = json!({"list": [1, 2, 3, 4, 5, 6]});
        let applied = small().apply(&mut v);
        assert_eq!(applied.items_dropped, 3);
        assert_eq!(v, json!({"list": [1, 2, 3, "…[truncated 3 items]"]}));

        let mut v = json!({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5});
        let applied = small().apply(&mut v);
        assert_eq!(applied.items_dropped, 2);
        let map = v.as_object().unwrap();
        assert_eq!(map.len(), 4);
        assert_eq!(map[DROPPED_MEMBERS_KEY], json!("2 members"));
    }

    #[test]
    fn long_keys_are_cut_too() {
        let mut v = json!({"a_very_long_key_name": 1});
        let applied = small().apply(&mut v);
        assert_eq!(applied.strings_truncated, 1);
        assert_eq!(v, json!({"a_very_l…[truncated 12 bytes]": 1}));
    }

    #[test]
    fn an_oversized_payload_is_replaced_by_a_preview() {
        let limits = Limits {
            max_payload_bytes: 100,
            max_string_bytes: 30,
            ..Limits::default()
        };
        let mut v = json!({"parts": (0..50).map(|i| format!("p{i}")).collect::<Vec<_>>()});
        let bytes = serde_json::to_string(&v).unwrap().len();
        let applied = limits.apply(&mut v);
        assert!(applied.payload_replaced);
        assert_eq!(v["truncated"], json!(true));
        assert_eq!(v["bytes"], json!(bytes));
        let preview = v["preview"].as_str().unwrap();
        assert!(
            preview.starts_with("{\"parts\":[\"p0\",\"p1\""),
            "{preview}"
        );
        assert!(preview.contains("…[truncated"), "{preview}");
        // Within the limit, nothing changes and nothing is reported.
        let mut fine = json!({"text": "hello"});
        assert!(!Limits::default().apply(&mut fine).any());
        assert_eq!(fine, json!({"text": "hello"}));
    }

    #[test]
    fn limits_read_from_partial_config() {
        let l: Limits = serde_json::from_value(json!({"max_depth": 4})).unwrap();
        assert_eq!(l.max_depth, 4);
        assert_eq!(l.max_string_bytes, Limits::default().max_string_bytes);
        assert_eq!(small().max_events(), 5);
    }
}
