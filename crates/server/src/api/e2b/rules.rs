//! E2B's network `rules` (`{host: [{transform: {headers: {name: value}}}]}`) on sandpit's
//! credential broker: the broker sets those headers on the sandbox's requests to the host,
//! filling each `${e2b.secrets.NAME}` with the owner's secret on the way out, so the
//! sandbox never holds the value. Rules grant no egress: `allowOut` still decides. The
//! same record keeps `maskRequestHost`, the Host the ingress gives requests to the
//! sandbox's ports.

use super::E2bError;
use crate::api::AppState;
use crate::error::ApiError;
use sandpit_broker::transform::{self, EgressRules};

/// The rules of an E2B `network` object (`None`: it has none).
pub fn parse(rules: Option<&serde_json::Value>) -> Result<Option<EgressRules>, E2bError> {
    match rules {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(raw) => transform::from_e2b(raw)
            .map(|r| (!r.hosts.is_empty()).then_some(r))
            .map_err(|e| E2bError::bad_request(e.0)),
    }
}

/// A `maskRequestHost` (`None`: not given).
pub fn mask(raw: Option<&serde_json::Value>) -> Result<Option<String>, E2bError> {
    match raw {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(m)) => transform::check_mask(m)
            .map(Some)
            .map_err(|e| E2bError::bad_request(e.0)),
        Some(_) => Err(E2bError::bad_request("maskRequestHost must be a string")),
    }
}

/// Adds `mask` to `rules`.
pub fn with_mask(rules: Option<EgressRules>, mask: Option<String>) -> Option<EgressRules> {
    match mask {
        None => rules,
        Some(m) => {
            let mut r = rules.unwrap_or_default();
            r.mask_request_host = Some(m);
            Some(r)
        }
    }
}

/// The rules and `maskRequestHost` of a create's `network` object.
pub fn of_create(network: Option<&serde_json::Value>) -> Result<Option<EgressRules>, E2bError> {
    let rules = parse(network.and_then(|n| n.get("rules")))?;
    let mask = mask(network.and_then(|n| n.get("maskRequestHost")))?;
    Ok(with_mask(rules, mask))
}

/// Checks, before a sandbox is made, that the broker can serve `rules` for `owner`.
pub async fn check(
    state: &AppState,
    owner: &str,
    rules: Option<&EgressRules>,
) -> Result<(), E2bError> {
    if let Some(r) = rules {
        state
            .broker
            .check_egress_rules(owner, r)
            .await
            .map_err(|e| E2bError(ApiError::from(e)))?;
    }
    Ok(())
}

/// The rules and `maskRequestHost` of sandbox `id` as sandbox info shows them (header
/// values as given: placeholders, never a secret's value).
pub fn shown(state: &AppState, id: &str) -> Option<serde_json::Value> {
    let r = state.broker.egress_rules(id)?;
    let mut m = serde_json::Map::new();
    if !r.hosts.is_empty() {
        m.insert("rules".into(), r.shown.clone());
    }
    if let Some(mask) = &r.mask_request_host {
        m.insert("maskRequestHost".into(), mask.clone().into());
    }
    Some(serde_json::Value::Object(m))
}

/// Gives sandbox `id` of `owner` these rules (`None`: clears them).
pub async fn install(
    state: &AppState,
    id: &str,
    owner: &str,
    rules: Option<EgressRules>,
) -> Result<(), E2bError> {
    state
        .broker
        .set_egress_rules(id, owner, rules)
        .await
        .map_err(|e| E2bError(ApiError::from(e)))
}
