//! Template routes: builds, their progress, inspection and removal.

use reqwest::Method;
use sandpit_api::{BuildTemplateRequest, Template, TemplateBuild};

use crate::{Client, ClientError};

impl Client {
    /// `POST /v1/templates` (admin key): starts a build and returns the template in state
    /// `building`; follow it with [`Client::template_build`].
    pub async fn build_template(
        &self,
        req: &BuildTemplateRequest,
    ) -> Result<Template, ClientError> {
        self.json(self.req(Method::POST, &["templates"])?.json(req))
            .await
    }

    /// `GET /v1/templates/{name}`.
    pub async fn get_template(&self, name: &str) -> Result<Template, ClientError> {
        self.json(self.req(Method::GET, &["templates", name])?)
            .await
    }

    /// `GET /v1/templates/{name}/build`: the build's state and its log lines from
    /// `offset` on, waiting up to `wait_ms` (at most 30 s) for new lines while it runs.
    pub async fn template_build(
        &self,
        name: &str,
        offset: u64,
        wait_ms: u64,
    ) -> Result<TemplateBuild, ClientError> {
        let rb = self
            .req(Method::GET, &["templates", name, "build"])?
            .query(&[("offset", offset), ("wait_ms", wait_ms)]);
        self.json(rb).await
    }

    /// `DELETE /v1/templates/{name}` (admin key): removes the template (cancelling a build
    /// under way); refused with 409 while sandboxes or pools use it.
    pub async fn delete_template(&self, name: &str) -> Result<(), ClientError> {
        self.send(self.req(Method::DELETE, &["templates", name])?)
            .await
            .map(drop)
    }
}
