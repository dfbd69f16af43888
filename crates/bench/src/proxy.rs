//! The proxy phase: small requests and a 64 MiB download through the daemon's sandbox
//! proxy (E2B's header form, with the traffic token) to python's http.server inside a
//! sandbox, each beside the same request made directly to the same server program on the
//! host's loopback, in the same run: the difference is what the proxy adds.

use super::report::Report;
use super::{Bench, MIB, TempDir, ms};
use anyhow::{Context, bail};
use futures::StreamExt;
use sandpit_api::{LimitsSpec, RunCommandRequest};
use std::time::{Duration, Instant};

/// Size of the small response timed per request.
const SMALL: usize = 1024;
/// Size of the download timed for throughput.
const BIG: u64 = 64 << 20;
/// Port of the server inside the sandbox.
const PORT: u16 = 8000;

/// The host-side server, killed when dropped.
struct HostServer(std::process::Child);

impl Drop for HostServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Times one GET and checks its size; returns milliseconds.
async fn timed_get(req: reqwest::RequestBuilder, want: u64) -> anyhow::Result<f64> {
    let t = Instant::now();
    let r = req.send().await.context("request")?;
    if !r.status().is_success() {
        bail!("answered {}", r.status());
    }
    let mut got = 0u64;
    let mut body = r.bytes_stream();
    while let Some(chunk) = body.next().await {
        got += chunk.context("response body")?.len() as u64;
    }
    if got != want {
        bail!("got {got} bytes, not {want}");
    }
    Ok(ms(t.elapsed()))
}

impl Bench {
    pub(super) async fn proxy(&self, report: &mut Report) -> anyhow::Result<()> {
        report.set("proxy_download.mb_per_s", None);
        report.set("baseline.direct_download.mb_per_s", None);
        let n = self.iterations.max(1);
        let dir = TempDir::new("proxy")?;
        let (small, big) = (dir.path().join("small"), dir.path().join("big"));
        std::fs::write(&small, vec![b'x'; SMALL]).context("write the small file")?;
        {
            let big = big.clone();
            tokio::task::spawn_blocking(move || super::phases::write_payload(&big, BIG))
                .await
                .context("the payload thread failed")??;
        }
        // The direct baseline: the same server program on the host's loopback.
        let host_port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("pick a free port")?
            .port();
        let _server = HostServer(
            std::process::Command::new("python3")
                .args(["-m", "http.server", &host_port.to_string()])
                .args(["--bind", "127.0.0.1", "--directory"])
                .arg(dir.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("start python3 -m http.server on the host")?,
        );
        let limits = LimitsSpec {
            memory_bytes: Some(1 << 30),
            disk_bytes: Some(512 << 20),
            ..Default::default()
        };
        let api = &self.api;
        let c = &api.client;
        let sb = api.create(&api.request(limits)).await?;
        let id = sb.id.clone();
        let result = async {
            let token = sb
                .traffic_access_token
                .clone()
                .context("the daemon returned no traffic token (no sandbox proxy?)")?;
            c.write_file(&id, "/tmp/www/small", vec![b'x'; SMALL])
                .await
                .context("write the small file")?;
            c.upload_from_file(&id, "/tmp/www/big", &big)
                .await
                .context("upload the big file")?;
            let serve = RunCommandRequest {
                argv: [
                    "python3",
                    "-m",
                    "http.server",
                    &PORT.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--directory",
                    "/tmp/www",
                ]
                .map(String::from)
                .to_vec(),
                ..Default::default()
            };
            c.run_background(&id, &serve)
                .await
                .context("start the server in the sandbox")?;
            let http = reqwest::Client::builder()
                .no_proxy()
                .build()
                .context("HTTP client")?;
            let direct = |path: &str| http.get(format!("http://127.0.0.1:{host_port}{path}"));
            let base = c.base_url().as_str().trim_end_matches('/').to_string();
            let proxied = |path: &str| {
                http.get(format!("{base}{path}"))
                    .header("e2b-sandbox-id", &id)
                    .header("e2b-sandbox-port", PORT.to_string())
                    .header("e2b-traffic-access-token", &token)
            };
            // Both servers up (a few seconds at most), and warm.
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                api.cancel.check()?;
                let up = timed_get(direct("/small"), SMALL as u64).await.is_ok()
                    && timed_get(proxied("/small"), SMALL as u64).await.is_ok();
                if up {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("the http.servers did not come up");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let (mut d, mut p) = (Vec::new(), Vec::new());
            // Interleaved, so that both see the same machine load.
            for _ in 0..n {
                api.cancel.check()?;
                d.push(timed_get(direct("/small"), SMALL as u64).await?);
                p.push(timed_get(proxied("/small"), SMALL as u64).await?);
            }
            let dd = timed_get(direct("/big"), BIG).await?;
            let pd = timed_get(proxied("/big"), BIG).await?;
            anyhow::Ok((d, p, dd, pd))
        }
        .await;
        let deleted = api.delete(&id).await;
        let (d, p, dd, pd) = result?;
        report.set_dist("baseline.direct_request", Ok(d));
        report.set_dist("proxy_request", Ok(p));
        let added = match (
            report.get("proxy_request.p50_ms"),
            report.get("baseline.direct_request.p50_ms"),
        ) {
            (Some(a), Some(b)) => Some(a - b),
            _ => None,
        };
        report.set("proxy_request.added_p50_ms", added);
        report.set_ratio(
            "proxy_request_vs_direct",
            "proxy_request.p50_ms",
            "baseline.direct_request.p50_ms",
        );
        let mib = BIG as f64 / MIB;
        report.set("proxy_download.mb_per_s", Some(mib / (pd / 1e3)));
        report.set("baseline.direct_download.mb_per_s", Some(mib / (dd / 1e3)));
        report.set_ratio(
            "proxy_download_vs_direct",
            "proxy_download.mb_per_s",
            "baseline.direct_download.mb_per_s",
        );
        report.note(
            "proxy_request",
            "GET of 1 KiB from python3 -m http.server: through the daemon's proxy into a \
             sandbox vs. the same server on the host's loopback (each request a new \
             connection, as http.server closes them)",
        );
        deleted
    }
}
