//! E2B's `/volumes` routes on sandpit's volumes (create, list, get, delete, by `volumeID`
//! or name), and the checks on `volumeMounts` of an E2B create; the volume-content API
//! (`/volumecontent/...`) is in `volume_content.rs`.

use super::E2bError;
use crate::api::{AppState, Owner};
use crate::error::ApiError;
use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use http::StatusCode;
use sandpit_store::VolumeRecord;
use serde::{Deserialize, Serialize};

/// Size of a volume made through E2B's API, whose create names no size (the file system
/// is sparse: it takes host disk only as it fills).
pub const E2B_VOLUME_SIZE: u64 = 1 << 30;

/// Directories a volume may not be mounted at or below: the sandbox's programs,
/// libraries and system configuration, and the agent's own sockets.
const SYSTEM_DIRS: &[&str] = &[
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr",
    "/etc",
    "/boot",
    "/run/sandpit",
];

/// Directories a volume may not replace (below them is fine): hiding them would take the
/// user's home, the runtime directory or the temporary directory away from the agent.
const WHOLE_DIRS: &[&str] = &["/home", "/home/user", "/root", "/run", "/var", "/tmp"];

/// `POST /volumes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewVolume {
    pub name: String,
}

/// A volume in a list.
#[derive(Debug, Serialize)]
pub struct VolumeInfo {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

/// A volume as create and get answer it.
#[derive(Debug, Serialize)]
pub struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    pub token: String,
}

/// The volume with its content token (`volume_content::volume_token`).
fn with_token(state: &AppState, v: VolumeRecord) -> Result<VolumeAndToken, E2bError> {
    Ok(VolumeAndToken {
        token: super::volume_content::volume_token(state, &v.id)?,
        volume_id: v.id,
        name: v.name,
    })
}

/// The volume of `owner` whose id or name is `selector`.
async fn find(state: &AppState, owner: &str, selector: &str) -> Result<VolumeRecord, E2bError> {
    let all = state.store.list_volumes(Some(owner)).await?;
    all.iter()
        .find(|v| v.id == selector)
        .or_else(|| all.iter().find(|v| v.name == selector))
        .cloned()
        .ok_or_else(|| E2bError(ApiError::not_found(format!("volume {selector} not found"))))
}

/// `POST /volumes`: 201 with the ready volume.
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    super::Required(req): super::Required<NewVolume>,
) -> Result<(StatusCode, Json<VolumeAndToken>), E2bError> {
    let create = sandpit_api::CreateVolumeRequest {
        name: req.name.clone(),
        size_bytes: E2B_VOLUME_SIZE,
    };
    state.manager.create_volume(&owner.0, &create).await?;
    let rec = state
        .store
        .get_volume(&owner.0, &req.name)
        .await?
        .ok_or_else(|| E2bError(ApiError::internal("the new volume's record is gone")))?;
    Ok((StatusCode::CREATED, Json(with_token(&state, rec)?)))
}

/// `GET /volumes`.
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<Vec<VolumeInfo>>, E2bError> {
    let all = state.store.list_volumes(Some(&owner.0)).await?;
    Ok(Json(
        all.into_iter()
            .map(|v| VolumeInfo {
                volume_id: v.id,
                name: v.name,
            })
            .collect(),
    ))
}

/// `GET /volumes/{id}`: another owner's is 404.
pub async fn get_one(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<VolumeAndToken>, E2bError> {
    Ok(Json(with_token(
        &state,
        find(&state, &owner.0, &id).await?,
    )?))
}

/// `DELETE /volumes/{id}`: 204; 409 while a sandbox has it mounted.
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let v = find(&state, &owner.0, &id).await?;
    state.manager.delete_volume(&owner.0, &v.name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Checks the `volumeMounts` of an E2B create beyond the checks every create gets
/// (absolute, no `.` or `..`, not `/`, `/proc`, `/sys`, `/dev`, `/.sandpit`, no two
/// nested): not over the system directories listed above.
pub fn check_mounts(mounts: &[super::types::VolumeMount]) -> Result<(), E2bError> {
    for m in mounts {
        let norm = sandpit_runtime::volume::check_target(&m.path)
            .map_err(|e| E2bError::bad_request(format!("volumeMounts: {e}")))?;
        let under = |d: &str| {
            norm == d || (norm.starts_with(d) && norm.as_bytes().get(d.len()) == Some(&b'/'))
        };
        if let Some(d) = SYSTEM_DIRS.iter().find(|d| under(d)) {
            return Err(E2bError::bad_request(format!(
                "volumeMounts: {} is at or under {d}, which the sandbox's system needs; mount it elsewhere (e.g. /mnt/{})",
                m.path, m.name
            )));
        }
        if WHOLE_DIRS.contains(&norm.as_str()) {
            return Err(E2bError::bad_request(format!(
                "volumeMounts: a volume cannot replace {norm}; mount it below it (e.g. {norm}/{})",
                m.name
            )));
        }
    }
    Ok(())
}

/// The volume-content API's paths (the SDKs send them with the volume's token, not an API
/// key, so they sit outside the authenticated routes).
pub fn content_routes() -> Router<AppState> {
    super::volume_content::routes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(path: &str) -> Vec<super::super::types::VolumeMount> {
        vec![super::super::types::VolumeMount {
            name: "data".into(),
            path: path.into(),
        }]
    }

    #[test]
    fn mount_paths_stay_off_the_system() {
        for ok in [
            "/mnt/data",
            "/home/user/data",
            "/data",
            "/var/lib/app",
            "/tmp/x",
        ] {
            assert!(check_mounts(&m(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "relative",
            "/mnt/../etc",
            "/",
            "/proc/x",
            "/.sandpit",
            "/usr",
            "/usr/local/bin",
            "/etc",
            "//etc/",
            "/bin",
            "/run/sandpit",
            "/run/sandpit/x",
            "/home/user",
            "/home",
            "/tmp",
            "/run",
        ] {
            assert!(check_mounts(&m(bad)).is_err(), "{bad}");
        }
    }
}
