//! The three wire APIs: what a request says (offered tools, the conversation so far,
//! streaming or not) and how an answer is written, as one JSON body or as SSE events.

pub(crate) mod chat;
pub(crate) mod messages;
pub(crate) mod responses;

use serde_json::Value;

/// A wire API the server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// OpenAI Chat Completions, `POST /v1/chat/completions` (pi, opencode).
    ChatCompletions,
    /// Anthropic Messages, `POST /v1/messages` (Claude Code).
    Messages,
    /// Anthropic token counting, `POST /v1/messages/count_tokens`.
    CountTokens,
    /// OpenAI Responses, `POST /v1/responses` (Codex).
    Responses,
    /// `GET /v1/models`, in a shape both OpenAI and Anthropic clients read.
    Models,
    /// Anything else: answered 404.
    Unknown,
}

/// What the server needs to know of a model request.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// The tools the request offers.
    pub tools: Vec<crate::script::OfferedTool>,
    /// Assistant turns already in the conversation (runs of consecutive assistant items).
    pub assistant_turns: usize,
    pub stream: bool,
    pub model: String,
    /// Chat Completions only: `stream_options.include_usage`.
    pub include_usage: bool,
    /// A rough token count of the request, so usage figures are non-zero and stable.
    pub input_tokens: u64,
}

/// An answer as the server writes it.
pub(crate) enum Answer {
    Json(Value),
    /// SSE events: an optional `event:` name and the `data:` line.
    Sse(Vec<(Option<&'static str>, String)>),
}

/// Counts runs of consecutive items for which `is_assistant` holds.
pub(crate) fn count_runs<'a>(
    items: impl IntoIterator<Item = &'a Value>,
    is_assistant: impl Fn(&Value) -> bool,
) -> usize {
    let mut runs = 0;
    let mut inside = false;
    for item in items {
        let a = is_assistant(item);
        if a && !inside {
            runs += 1;
        }
        inside = a;
    }
    runs
}

/// About four bytes a token: close enough for usage figures nobody bills.
pub(crate) fn estimate_tokens(bytes: usize) -> u64 {
    u64::try_from(bytes / 4 + 1).unwrap_or(u64::MAX)
}

/// Splits `s` into up to `parts` pieces at character boundaries, so streamed text and
/// arguments arrive as several deltas the client has to join.
pub(crate) fn pieces(s: &str, parts: usize) -> Vec<&str> {
    let chars = s.chars().count();
    if chars == 0 {
        return Vec::new();
    }
    let per = chars.div_ceil(parts.max(1));
    let mut out = Vec::new();
    let mut start = 0;
    let mut count = 0;
    for (i, _) in s.char_indices() {
        if count == per {
            out.push(&s[start..i]);
            start = i;
            count = 0;
        }
        count += 1;
    }
    out.push(&s[start..]);
    out
}

/// The output token count of an answer.
pub(crate) fn output_tokens(text: Option<&str>, calls: &[crate::script::ResolvedCall]) -> u64 {
    let bytes = text.map_or(0, str::len)
        + calls
            .iter()
            .map(|c| c.name.len() + c.arguments.to_string().len())
            .sum::<usize>();
    estimate_tokens(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pieces_join_back_and_respect_char_boundaries() {
        for s in ["", "a", "hello world", "héllo wörld ✓✓✓"] {
            let p = pieces(s, 3);
            assert_eq!(p.concat(), s);
            assert!(p.len() <= 3);
            if s.chars().count() >= 3 {
                assert_eq!(p.len(), 3, "{s}");
            }
        }
    }

    #[test]
    fn runs_of_assistant_items_count_once() {
        let items = [
            json!({"role": "user"}),
            json!({"role": "assistant"}),
            json!({"role": "assistant"}),
            json!({"role": "tool"}),
            json!({"role": "assistant"}),
        ];
        assert_eq!(count_runs(&items, |v| v["role"] == "assistant"), 2);
        assert_eq!(count_runs(&items[..1], |v| v["role"] == "assistant"), 0);
    }
}
