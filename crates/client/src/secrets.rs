//! The credential broker's secrets, and which of them a sandbox may use.

use reqwest::Method;
use sandpit_api::secrets::{CreateSecretRequest, SandboxSecrets, Secret, SecretList};

use crate::{Client, ClientError};

fn owner_query(owner: Option<&str>) -> Vec<(&'static str, String)> {
    owner
        .map(|o| vec![("owner", o.to_string())])
        .unwrap_or_default()
}

impl Client {
    /// `POST /v1/secrets`: stores a secret (of `owner`, with the admin key); the answer
    /// describes it without its value.
    pub async fn create_secret(
        &self,
        req: &CreateSecretRequest,
        owner: Option<&str>,
    ) -> Result<Secret, ClientError> {
        self.json(
            self.req(Method::POST, &["secrets"])?
                .query(&owner_query(owner))
                .json(req),
        )
        .await
    }

    /// `GET /v1/secrets`.
    pub async fn list_secrets(&self, owner: Option<&str>) -> Result<Vec<Secret>, ClientError> {
        let list: SecretList = self
            .json(
                self.req(Method::GET, &["secrets"])?
                    .query(&owner_query(owner)),
            )
            .await?;
        Ok(list.items)
    }

    /// `GET /v1/secrets/{name}`.
    pub async fn get_secret(&self, name: &str, owner: Option<&str>) -> Result<Secret, ClientError> {
        self.json(
            self.req(Method::GET, &["secrets", name])?
                .query(&owner_query(owner)),
        )
        .await
    }

    /// `DELETE /v1/secrets/{name}`.
    pub async fn delete_secret(&self, name: &str, owner: Option<&str>) -> Result<(), ClientError> {
        self.send(
            self.req(Method::DELETE, &["secrets", name])?
                .query(&owner_query(owner)),
        )
        .await
        .map(drop)
    }

    /// `GET /v1/sandboxes/{id}/secrets`: names of the secrets the sandbox may use.
    pub async fn sandbox_secrets(&self, id: &str) -> Result<Vec<String>, ClientError> {
        let s: SandboxSecrets = self
            .json(self.req(Method::GET, &["sandboxes", id, "secrets"])?)
            .await?;
        Ok(s.secrets)
    }

    /// `PUT /v1/sandboxes/{id}/secrets`: replaces the secrets the sandbox may use.
    pub async fn set_sandbox_secrets(
        &self,
        id: &str,
        names: &[String],
    ) -> Result<Vec<String>, ClientError> {
        let body = SandboxSecrets {
            secrets: names.to_vec(),
        };
        let s: SandboxSecrets = self
            .json(
                self.req(Method::PUT, &["sandboxes", id, "secrets"])?
                    .json(&body),
            )
            .await?;
        Ok(s.secrets)
    }
}
