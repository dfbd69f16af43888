//! E2B's `/secrets` routes on the credential broker: create, list (paged), get, update (a
//! new version of the value) and delete, by `secretID` or name. A value goes in and never
//! comes back: no answer, log line or error message holds it. Secrets made here are bound
//! to no host; a sandbox's network `rules` send them (see `rules.rs`).

use super::{E2bError, rfc3339};
use crate::api::{AppState, Owner};
use crate::error::ApiError;
use axum::Json;
use axum::extract::{FromRequest, Path, Request, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use sandpit_store::E2bSecretRecord;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /secrets`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSecret {
    pub name: String,
    pub value: String,
    pub metadata: Option<BTreeMap<String, String>>,
}

/// `POST /secrets/{id}`: a new version of the value, and new metadata when given.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretUpdate {
    pub value: String,
    pub metadata: Option<BTreeMap<String, String>>,
}

/// A secret as E2B shows it: never its value.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Secret {
    #[serde(rename = "secretID")]
    pub secret_id: String,
    pub name: String,
    pub current_version: i64,
    pub metadata: serde_json::Value,
    pub created_at: String,
    pub updated_at: String,
}

fn view(r: E2bSecretRecord) -> Secret {
    Secret {
        secret_id: r.id,
        name: r.name,
        current_version: r.version,
        metadata: if r.metadata.is_object() {
            r.metadata
        } else {
            serde_json::json!({})
        },
        created_at: rfc3339(r.created_at_ms),
        updated_at: rfc3339(r.updated_at_ms),
    }
}

/// A JSON body whose parse errors say where, never what: the text around an error could
/// be the secret's value.
pub struct SecretBody<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for SecretBody<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| E2bError(ApiError::new(e.status(), "e2b", e.body_text())))?;
        serde_json::from_slice(&bytes).map(SecretBody).map_err(|e| {
            let what = match e.classify() {
                serde_json::error::Category::Data => {
                    "a field is missing, unknown or of the wrong type"
                }
                _ => "not valid JSON",
            };
            E2bError(ApiError::bad_request(format!(
                "invalid body ({what}) at line {} column {}: expected {{name, value, metadata?}}",
                e.line(),
                e.column()
            )))
        })
    }
}

fn broker_err(e: sandpit_broker::BrokerError) -> E2bError {
    E2bError(ApiError::from(e))
}

/// `POST /secrets`: 201 with the new secret (version 1).
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    SecretBody(req): SecretBody<NewSecret>,
) -> Result<(StatusCode, Json<Secret>), E2bError> {
    let rec = state
        .broker
        .create_e2b_secret(
            &owner.0,
            &req.name,
            &req.value,
            &req.metadata.unwrap_or_default(),
        )
        .await
        .map_err(broker_err)?;
    Ok((StatusCode::CREATED, Json(view(rec))))
}

/// `GET /secrets?limit=&nextToken=`: a page by name; `X-Next-Token` when there are more.
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    uri: http::Uri,
) -> Result<Response, E2bError> {
    let mut limit: i64 = 100;
    let mut after = None;
    for (k, v) in form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=sandpit_broker::e2b::MAX_PAGE).contains(n))
                    .ok_or_else(|| {
                        E2bError::bad_request(format!(
                            "limit must be a number from 1 to {}",
                            sandpit_broker::e2b::MAX_PAGE
                        ))
                    })?;
            }
            "nextToken" if !v.is_empty() => after = Some(v.into_owned()),
            _ => {}
        }
    }
    // One more than asked says whether another page follows.
    let mut page = state
        .broker
        .list_e2b_secrets(&owner.0, after.as_deref(), limit + 1)
        .await
        .map_err(broker_err)?;
    let more = page.len() as i64 > limit;
    page.truncate(limit as usize);
    let next = more.then(|| page.last().map(|s| s.name.clone())).flatten();
    let body: Vec<Secret> = page.into_iter().map(view).collect();
    let mut resp = Json(body).into_response();
    if let Some(v) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// `GET /secrets/{id}`: by id or name; another owner's is 404.
pub async fn get_one(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Secret>, E2bError> {
    let rec = state
        .broker
        .get_e2b_secret(&owner.0, &id)
        .await
        .map_err(broker_err)?;
    Ok(Json(view(rec)))
}

/// `POST /secrets/{id}`: stores the value as the next version.
pub async fn update(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    SecretBody(req): SecretBody<SecretUpdate>,
) -> Result<Json<Secret>, E2bError> {
    let rec = state
        .broker
        .update_e2b_secret(&owner.0, &id, &req.value, req.metadata.as_ref())
        .await
        .map_err(broker_err)?;
    Ok(Json(view(rec)))
}

/// `DELETE /secrets/{id}`: 204; rules naming it refuse their requests from then on.
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    state
        .broker
        .delete_e2b_secret(&owner.0, &id)
        .await
        .map_err(broker_err)?;
    Ok(StatusCode::NO_CONTENT)
}
