//! Redaction of event payloads before they are stored.
//!
//! Three rules, applied at every depth of a JSON value:
//! 1. **Sensitive keys.** The value of every object member whose key names a credential
//!    ([`is_sensitive_key`]: password, secret, token, authorization, api key, cookie,
//!    credential, private key, ... in any case and with any separators) becomes [`MASK`],
//!    whatever its type (an object or array under such a key goes whole).
//! 2. **Known secret values.** Every occurrence of a value the [`Redactor`] was given (the
//!    broker's secrets, the sandbox's secret env) inside any string, object key or array
//!    element becomes [`MASK`]; values shorter than [`MIN_SECRET_BYTES`] are ignored, as
//!    masking them would erase ordinary text.
//! 3. **Secrets in text.** Inside strings, `key: value` and `key=value` where the key is
//!    sensitive (headers, `.env` lines, JSON or YAML printed by a tool), and `Bearer` or
//!    `Basic` credentials, have their value masked.
//!
//! Redaction errs on the side of masking: a key such as `token_count` is masked too. It is
//! a last line of defence for what a harness prints, not a substitute for keeping secrets
//! out of the sandbox (the broker's placeholders do that). Encodings of a secret (base64,
//! URL-escaped) are not recognised.

use std::borrow::Cow;
use std::fmt;

use serde_json::Value;

use crate::limits::drop_flat;

/// What a masked value is replaced by.
pub const MASK: &str = "[redacted]";

/// Known secret values shorter than this are not searched for in text.
pub const MIN_SECRET_BYTES: usize = 4;

/// Masks secrets in event payloads; built once per run with its known secret values.
#[derive(Clone, Default)]
pub struct Redactor {
    /// Longest first, so a secret that contains another is masked whole.
    secrets: Vec<String>,
}

impl fmt::Debug for Redactor {
    // The values themselves must never reach a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redactor")
            .field("secrets", &self.secrets.len())
            .finish()
    }
}

/// Substrings of a squashed key (lowercase, alphanumerics only) that make it sensitive.
const SENSITIVE_PARTS: [&str; 13] = [
    "password",
    "passwd",
    "passphrase",
    "secret",
    "authorization",
    "apikey",
    "cookie",
    "credential",
    "privatekey",
    "accesskey",
    "sessionkey",
    "bearer",
    "signingkey",
];

/// Whole words of a key (split at separators and camelCase) that make it sensitive.
const SENSITIVE_WORDS: [&str; 5] = ["token", "auth", "jwt", "oauth", "otp"];

/// Whether an object key names a credential: `password`, `api_key`, `apiKey`, `X-Api-Key`,
/// `Authorization`, `Set-Cookie`, `access_token`, `client_secret`, `githubToken`, ...
/// Counts such as `input_tokens` or `max_tokens` (plural) are not.
pub fn is_sensitive_key(key: &str) -> bool {
    let squashed: String = key
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    if squashed.is_empty() {
        return false;
    }
    if SENSITIVE_PARTS.iter().any(|p| squashed.contains(p)) || squashed.ends_with("token") {
        return true;
    }
    words(key)
        .iter()
        .any(|w| SENSITIVE_WORDS.contains(&w.as_str()))
}

/// Lowercase words of a key: split at every non-alphanumeric character and at camelCase
/// boundaries (`XApiKey` → `x`, `api`, `key`; `APIKey` → `api`, `key`).
fn words(key: &str) -> Vec<String> {
    let chars: Vec<char> = key.chars().collect();
    let mut out = Vec::new();
    let mut word = String::new();
    for (i, &c) in chars.iter().enumerate() {
        if !c.is_ascii_alphanumeric() {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            continue;
        }
        let prev = i.checked_sub(1).map(|p| chars[p]);
        let next = chars.get(i + 1).copied();
        let boundary = c.is_ascii_uppercase()
            && prev.is_some_and(|p| {
                p.is_ascii_lowercase()
                    || p.is_ascii_digit()
                    || (p.is_ascii_uppercase() && next.is_some_and(|n| n.is_ascii_lowercase()))
            });
        if boundary && !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        word.push(c.to_ascii_lowercase());
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

fn is_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')
}

fn is_quote(b: u8) -> bool {
    b == b'"' || b == b'\''
}

/// Masks the values of `key: value` / `key=value` with a sensitive key inside `s`.
fn mask_assignments(s: &str, count: &mut usize) -> Option<String> {
    let b = s.as_bytes();
    let mut out = String::new();
    let mut last = 0;
    let mut i = 0;
    while i < b.len() {
        if !is_key_byte(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && is_key_byte(b[i]) {
            i += 1;
        }
        if !is_sensitive_key(&s[start..i]) {
            continue;
        }
        let quote_before = start.checked_sub(1).map(|p| b[p]).filter(|&q| is_quote(q));
        let mut j = i;
        let key_quoted = quote_before.is_some() && j < b.len() && Some(b[j]) == quote_before;
        if key_quoted {
            j += 1;
        }
        while j < b.len() && (b[j] == b' ' || b[j] == b'\t') {
            j += 1;
        }
        let Some(&sep) = b.get(j).filter(|&&c| c == b':' || c == b'=') else {
            continue;
        };
        // `token::Token`, `token == x` and `token => x` are code, not assignments.
        if b.get(j + 1).is_some_and(|&n| n == sep || n == b'>') {
            continue;
        }
        j += 1;
        while j < b.len() && (b[j] == b' ' || b[j] == b'\t') {
            j += 1;
        }
        let (value_start, value_end) = if j < b.len() && is_quote(b[j]) {
            let q = b[j];
            let mut k = j + 1;
            while k < b.len() && b[k] != q && b[k] != b'\n' {
                k += if b[k] == b'\\' { 2 } else { 1 };
            }
            (j + 1, k.min(b.len()))
        } else {
            let mut k = j;
            while k < b.len() {
                let c = b[k];
                let stop = c == b'\n'
                    || c == b'\r'
                    || if key_quoted {
                        matches!(c, b',' | b'}' | b']' | b' ' | b'\t')
                    } else if let Some(q) = quote_before {
                        c == q
                    } else if sep == b'=' {
                        matches!(c, b' ' | b'\t' | b'&' | b';' | b',' | b'"' | b'\'')
                    } else {
                        false
                    };
                if stop {
                    break;
                }
                k += 1;
            }
            while k > j && (b[k - 1] == b' ' || b[k - 1] == b'\t') {
                k -= 1;
            }
            (j, k)
        };
        if value_end <= value_start || &s[value_start..value_end] == MASK {
            i = value_end.max(i);
            continue;
        }
        out.push_str(&s[last..value_start]);
        out.push_str(MASK);
        *count += 1;
        last = value_end;
        i = value_end;
    }
    if last == 0 {
        return None;
    }
    out.push_str(&s[last..]);
    Some(out)
}

/// Masks what follows `Bearer ` or `Basic ` when it looks like a credential (16 or more
/// token characters, so prose such as "basic idea" stays).
fn mask_schemes(s: &str, count: &mut usize) -> Option<String> {
    const MIN_CREDENTIAL: usize = 16;
    let lower = s.to_ascii_lowercase();
    let b = s.as_bytes();
    let mut out = String::new();
    let mut last = 0;
    let mut from = 0;
    loop {
        let found = ["bearer", "basic"]
            .iter()
            .filter_map(|w| lower[from..].find(w).map(|at| (from + at, w.len())))
            .min();
        let Some((at, len)) = found else { break };
        from = at + len;
        if at > 0 && b[at - 1].is_ascii_alphanumeric() {
            continue;
        }
        let mut j = at + len;
        let spaces = j;
        while j < b.len() && b[j] == b' ' {
            j += 1;
        }
        if j == spaces {
            continue;
        }
        let value_start = j;
        while j < b.len()
            && (b[j].is_ascii_alphanumeric()
                || matches!(b[j], b'-' | b'.' | b'_' | b'~' | b'+' | b'/' | b'='))
        {
            j += 1;
        }
        if j - value_start < MIN_CREDENTIAL {
            continue;
        }
        out.push_str(&s[last..value_start]);
        out.push_str(MASK);
        *count += 1;
        last = j;
        from = j;
    }
    if last == 0 {
        return None;
    }
    out.push_str(&s[last..]);
    Some(out)
}

impl Redactor {
    /// A redactor that also masks these known secret values (those shorter than
    /// [`MIN_SECRET_BYTES`] are left out).
    pub fn new<I, S>(secrets: I) -> Redactor
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut secrets: Vec<String> = secrets
            .into_iter()
            .map(|s| s.as_ref().to_string())
            .filter(|s| s.len() >= MIN_SECRET_BYTES)
            .collect();
        secrets.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        secrets.dedup();
        Redactor { secrets }
    }

    /// How many known secret values it searches for.
    pub fn known_secrets(&self) -> usize {
        self.secrets.len()
    }

    /// `s` with every secret in it masked (rules 2 and 3 of the module docs).
    pub fn redact_text<'a>(&self, s: &'a str) -> Cow<'a, str> {
        let mut count = 0;
        self.mask_text(s, &mut count)
    }

    fn mask_text<'a>(&self, s: &'a str, count: &mut usize) -> Cow<'a, str> {
        let mut text = Cow::Borrowed(s);
        for secret in &self.secrets {
            let n = text.matches(secret.as_str()).count();
            if n > 0 {
                text = Cow::Owned(text.replace(secret.as_str(), MASK));
                *count += n;
            }
        }
        if let Some(masked) = mask_assignments(&text, count) {
            text = Cow::Owned(masked);
        }
        if let Some(masked) = mask_schemes(&text, count) {
            text = Cow::Owned(masked);
        }
        text
    }

    /// Masks `value` in place at every depth and returns how many values were masked. It
    /// walks with its own stack, so no depth of input can exhaust the thread's.
    pub fn redact(&self, value: &mut Value) -> usize {
        let mut count = 0;
        let mut stack: Vec<&mut Value> = vec![value];
        while let Some(v) = stack.pop() {
            match v {
                Value::String(s) => {
                    if let Cow::Owned(masked) = self.mask_text(s, &mut count) {
                        *s = masked;
                    }
                }
                Value::Array(items) => stack.extend(items.iter_mut()),
                Value::Object(map) => {
                    let renamed: Vec<(String, String)> = map
                        .keys()
                        .filter_map(|k| match self.mask_known(k, &mut count) {
                            Cow::Owned(masked) => Some((k.clone(), masked)),
                            Cow::Borrowed(_) => None,
                        })
                        .collect();
                    for (old, new) in renamed {
                        if let Some(child) = map.remove(&old) {
                            map.insert(new, child);
                        }
                    }
                    for (key, child) in map.iter_mut() {
                        if is_sensitive_key(key) {
                            if !child.is_null() && child.as_str() != Some(MASK) {
                                drop_flat(std::mem::replace(child, Value::String(MASK.into())));
                                count += 1;
                            }
                        } else {
                            stack.push(child);
                        }
                    }
                }
                Value::Null | Value::Bool(_) | Value::Number(_) => {}
            }
        }
        count
    }

    /// Only the known secret values (keys get no assignment or scheme rules).
    fn mask_known<'a>(&self, s: &'a str, count: &mut usize) -> Cow<'a, str> {
        let mut text = Cow::Borrowed(s);
        for secret in &self.secrets {
            let n = text.matches(secret.as_str()).count();
            if n > 0 {
                text = Cow::Owned(text.replace(secret.as_str(), MASK));
                *count += n;
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sensitive_keys_in_any_case_and_separator() {
        for key in [
            "password",
            "Password",
            "PASSWORD",
            "user_password",
            "db-passwd",
            "passphrase",
            "secret",
            "client_secret",
            "clientSecret",
            "AWS_SECRET_ACCESS_KEY",
            "secretKey",
            "token",
            "Token",
            "access_token",
            "accessToken",
            "refresh-token",
            "id_token",
            "githubToken",
            "GITHUB_TOKEN",
            "x-auth-token",
            "sessionToken",
            "authorization",
            "Authorization",
            "Proxy-Authorization",
            "auth",
            "basic_auth",
            "authHeader",
            "api_key",
            "apiKey",
            "ApiKey",
            "APIKEY",
            "API-KEY",
            "x-api-key",
            "X-Api-Key",
            "XApiKey",
            "openai.api_key",
            "cookie",
            "Cookie",
            "set-cookie",
            "Set-Cookie",
            "cookies",
            "credentials",
            "credential",
            "private_key",
            "privateKey",
            "access_key",
            "jwt",
            "oauth",
            "bearer",
            "sessionKey",
        ] {
            assert!(is_sensitive_key(key), "{key} should be sensitive");
        }
        for key in [
            "author",
            "authority",
            "input_tokens",
            "output_tokens",
            "cache_read_input_tokens",
            "max_tokens",
            "tokens",
            "tokenizer",
            "key",
            "monkey",
            "keyboard",
            "path",
            "session_id",
            "sessionID",
            "command",
            "",
            "---",
        ] {
            assert!(!is_sensitive_key(key), "{key} should not be sensitive");
        }
    }

    #[test]
    fn words_split_at_separators_and_camel_case() {
        assert_eq!(words("XApiKey"), ["x", "api", "key"]);
        assert_eq!(words("APIKey"), ["api", "key"]);
        assert_eq!(words("access_token"), ["access", "token"]);
        assert_eq!(words("refreshToken2"), ["refresh", "token2"]);
        assert_eq!(words("set-cookie"), ["set", "cookie"]);
    }

    #[test]
    fn sensitive_members_are_masked_at_any_depth() {
        let r = Redactor::default();
        let mut v = json!({
            "a": [{"b": [{"password": "hunter2", "user": "bob"}]}],
            "headers": {"Authorization": "Bearer x", "X-Api-Key": "k", "Accept": "*/*"},
            "nested": [[[{"deeper": {"ACCESS_TOKEN": 12345}}]]],
            "credentials": {"user": "u", "pass": "p"},
            "apiKeys": ["one", "two"],
            "token": null,
            "usage": {"input_tokens": 10, "output_tokens": 3},
        });
        let n = r.redact(&mut v);
        assert_eq!(n, 6);
        assert_eq!(
            v,
            json!({
                "a": [{"b": [{"password": MASK, "user": "bob"}]}],
                "headers": {"Authorization": MASK, "X-Api-Key": MASK, "Accept": "*/*"},
                "nested": [[[{"deeper": {"ACCESS_TOKEN": MASK}}]]],
                "credentials": MASK,
                "apiKeys": MASK,
                "token": null,
                "usage": {"input_tokens": 10, "output_tokens": 3},
            })
        );
        // Running it again finds nothing more.
        assert_eq!(r.redact(&mut v), 0);
    }

    #[test]
    fn known_secrets_are_masked_wherever_they_appear() {
        let r = Redactor::new(["sk-live-12345", "sk-live-12345-extended", "hunter22"]);
        let mut v = json!({
            "output": "key sk-live-12345 and again sk-live-12345!",
            "embedded": "prefixsk-live-12345suffix",
            "longer": "sk-live-12345-extended",
            "list": ["a", "sk-live-12345", ["deep hunter22"]],
            "sk-live-12345": "a key that is the secret",
            "objs": [{"x": {"y": "…hunter22…"}}],
        });
        let n = r.redact(&mut v);
        assert_eq!(
            v,
            json!({
                "output": format!("key {MASK} and again {MASK}!"),
                "embedded": format!("prefix{MASK}suffix"),
                "longer": MASK,
                "list": ["a", MASK, [format!("deep {MASK}")]],
                MASK: "a key that is the secret",
                "objs": [{"x": {"y": format!("…{MASK}…")}}],
            })
        );
        assert_eq!(n, 8);
        let text = serde_json::to_string(&v).unwrap();
        assert!(!text.contains("sk-live"), "{text}");
        assert!(!text.contains("hunter22"), "{text}");
    }

    #[test]
    fn short_known_values_are_not_searched_for() {
        let r = Redactor::new(["abc", "", "abcd"]);
        assert_eq!(r.known_secrets(), 1);
        assert_eq!(r.redact_text("abc abcd"), format!("abc {MASK}"));
    }

    #[test]
    fn secrets_in_text_assignments_and_headers() {
        let r = Redactor::default();
        let cases = [
            (
                "API_KEY=sk-abc123 ./run.sh",
                format!("API_KEY={MASK} ./run.sh"),
            ),
            (
                "export GITHUB_TOKEN=\"ghp_x1\"",
                format!("export GITHUB_TOKEN=\"{MASK}\""),
            ),
            (
                "{\"password\": \"hunter2\", \"user\": \"bob\"}",
                format!("{{\"password\": \"{MASK}\", \"user\": \"bob\"}}"),
            ),
            (
                "{\"apiKey\":12345,\"n\":1}",
                format!("{{\"apiKey\":{MASK},\"n\":1}}"),
            ),
            (
                "> Authorization: Bearer abc.def\n> Accept: */*",
                format!("> Authorization: {MASK}\n> Accept: */*"),
            ),
            (
                "curl -H 'X-Api-Key: k123' https://x.example",
                format!("curl -H 'X-Api-Key: {MASK}' https://x.example"),
            ),
            (
                "password: hunter2\nuser: bob",
                format!("password: {MASK}\nuser: bob"),
            ),
            (
                "https://h/?api_key=k1&q=2",
                format!("https://h/?api_key={MASK}&q=2"),
            ),
            ("Set-Cookie: sid=1; Path=/", format!("Set-Cookie: {MASK}")),
        ];
        for (input, want) in cases {
            assert_eq!(r.redact_text(input), want, "{input}");
        }
        for untouched in [
            "input_tokens: 5, output_tokens: 7",
            "if token == expected { return }",
            "use crate::token::Token;",
            "the basic idea is simple",
            "a bearer of news",
            "author: Jane",
        ] {
            assert_eq!(r.redact_text(untouched), untouched);
        }
    }

    #[test]
    fn bearer_and_basic_credentials_in_text() {
        let r = Redactor::default();
        assert_eq!(
            r.redact_text("calling with bearer eyJhbGciOiJIUzI1NiJ9.e30.sig now"),
            format!("calling with bearer {MASK} now")
        );
        assert_eq!(
            r.redact_text("Basic dXNlcjpwYXNzd29yZDEyMzQ="),
            format!("Basic {MASK}")
        );
    }

    #[test]
    fn a_very_deep_value_does_not_overflow_the_stack() {
        let mut v = json!({"password": "x"});
        for _ in 0..100_000 {
            v = Value::Array(vec![v]);
        }
        assert_eq!(Redactor::default().redact(&mut v), 1);
        crate::limits::drop_flat(v);
    }

    #[test]
    fn debug_output_hides_the_values() {
        let r = Redactor::new(["super-secret-value"]);
        let printed = format!("{r:?}");
        assert!(!printed.contains("super-secret"), "{printed}");
    }
}
