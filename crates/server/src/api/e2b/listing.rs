//! `GET /v2/sandboxes` as E2B lists: newest first unless `order=asc`, `startedAfter`
//! inclusive, and pages of `limit` whose next token comes in `X-Next-Token`.

use super::E2bError;
use super::sandboxes::{listed, metadata_filter, query_pairs};
use super::types::ListedSandbox;
use crate::api::{AppState, Owner};
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue};
use sandpit_store::{SandboxFilter, SandboxState};

/// E2B's page size when the query names none.
const DEFAULT_LIMIT: u32 = 100;

/// The query of `GET /v2/sandboxes` as a store filter; unknown parameters and values are
/// refused rather than ignored, so a misspelt filter never lists more than asked.
pub fn filter_of(
    pairs: &[(String, String)],
    owner: &str,
    aliases: &std::collections::BTreeMap<String, String>,
) -> Result<SandboxFilter, E2bError> {
    let mut filter = SandboxFilter {
        owner: Some(owner.to_string()),
        limit: DEFAULT_LIMIT,
        newest_first: true,
        ..Default::default()
    };
    for (k, v) in pairs {
        match k.as_str() {
            "metadata" => filter.metadata.extend(metadata_filter(v)),
            "state" => {
                for s in v.split(',').filter(|s| !s.is_empty()) {
                    match s {
                        "running" => filter.states.push(SandboxState::Running),
                        "paused" => filter
                            .states
                            .extend([SandboxState::Paused, SandboxState::Hibernated]),
                        other => {
                            return Err(E2bError::bad_request(format!(
                                "unknown state {other:?} (running, paused)"
                            )));
                        }
                    }
                }
            }
            "limit" => {
                let n: u32 = v
                    .parse()
                    .map_err(|_| E2bError::bad_request("limit must be a number"))?;
                if n == 0 || n > 1000 {
                    return Err(E2bError::bad_request("limit must be between 1 and 1000"));
                }
                filter.limit = n;
            }
            "nextToken" if !v.is_empty() => filter.cursor = Some(v.clone()),
            "nextToken" => {}
            "template" => {
                filter.template = Some(aliases.get(v).cloned().unwrap_or_else(|| v.clone()))
            }
            "startedAfter" => filter.created_from_ms = Some(parse_time(v)?),
            "order" => {
                filter.newest_first = match v.as_str() {
                    "desc" => true,
                    "asc" => false,
                    other => {
                        return Err(E2bError::bad_request(format!(
                            "unknown order {other:?} (asc, desc)"
                        )));
                    }
                }
            }
            other => {
                return Err(E2bError::bad_request(format!(
                    "unknown query parameter {other:?}"
                )));
            }
        }
    }
    if filter.states.is_empty() {
        filter.states = vec![
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Hibernated,
        ];
    } else if filter.states.contains(&SandboxState::Running) {
        // E2B shows a sandbox that is still starting as running.
        filter.states.push(SandboxState::Creating);
    }
    Ok(filter)
}

/// RFC 3339 text as unix milliseconds (finer digits are dropped: start times are kept
/// to the millisecond, so an inclusive bound still matches the time it was read from).
fn parse_time(t: &str) -> Result<i64, E2bError> {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::parse(t, &Rfc3339)
        .map(|d| (d.unix_timestamp_nanos().div_euclid(1_000_000)) as i64)
        .map_err(|_| E2bError::bad_request(format!("invalid time {t:?} (RFC 3339)")))
}

/// `GET /v2/sandboxes`: running and paused sandboxes, filtered by state, metadata,
/// template and start time, a page at a time.
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    uri: http::Uri,
) -> Result<Response, E2bError> {
    let filter = filter_of(&query_pairs(&uri), &owner.0, &state.e2b.templates)?;
    let page = state.store.list_sandboxes(&filter).await?;
    let items: Vec<ListedSandbox> = page.items.iter().map(listed).collect();
    let mut headers = HeaderMap::new();
    if let Some(next) = page.next_cursor
        && let Ok(v) = HeaderValue::from_str(&next)
    {
        headers.insert("x-next-token", v);
    }
    Ok((headers, Json(items)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(q: &[(&str, &str)]) -> Vec<(String, String)> {
        q.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn filter(q: &[(&str, &str)]) -> Result<SandboxFilter, E2bError> {
        let aliases = [("base".to_string(), "host".to_string())].into();
        filter_of(&pairs(q), "alice", &aliases)
    }

    #[test]
    fn defaults_are_newest_first_pages_of_100_live_states() {
        let f = filter(&[]).expect("a filter");
        assert!(f.newest_first);
        assert_eq!(f.limit, 100);
        assert_eq!(f.owner.as_deref(), Some("alice"));
        assert_eq!(f.states.len(), 4);
        assert!(!f.states.iter().any(|s| s.is_final()));
    }

    #[test]
    fn order_start_template_and_token_are_read() {
        let f = filter(&[
            ("order", "asc"),
            ("startedAfter", "2026-12-06T01:48:27.669000+00:00"),
            ("template", "base"),
            ("nextToken", "abc"),
            ("limit", "2"),
            ("state", "paused"),
        ])
        .expect("a filter");
        assert!(!f.newest_first);
        // 2026-12-06T01:48:27.669Z
        assert_eq!(f.created_from_ms, Some(1_796_521_707_669));
        assert_eq!(f.template.as_deref(), Some("host"));
        assert_eq!(f.cursor.as_deref(), Some("abc"));
        assert_eq!(f.limit, 2);
        assert_eq!(
            f.states,
            [SandboxState::Paused, SandboxState::Hibernated].to_vec()
        );
        assert!(filter(&[("order", "desc")]).expect("a filter").newest_first);
        // An empty token is the first page.
        assert_eq!(filter(&[("nextToken", "")]).expect("a filter").cursor, None);
        // Finer digits than milliseconds do not move the bound past the millisecond.
        let f = filter(&[("startedAfter", "2026-12-06T01:48:27.669999Z")]).expect("a filter");
        assert_eq!(f.created_from_ms, Some(1_796_521_707_669));
    }

    #[test]
    fn bad_queries_are_refused() {
        for q in [
            [("order", "newest")],
            [("limit", "0")],
            [("limit", "1001")],
            [("limit", "x")],
            [("state", "stopped")],
            [("startedAfter", "yesterday")],
            [("sort", "asc")],
        ] {
            let e = filter(&q).expect_err("refused");
            assert_eq!(e.0.status, http::StatusCode::BAD_REQUEST, "{q:?}");
        }
    }
}
