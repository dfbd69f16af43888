fn main() {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    if std::path::Path::new(&argv0).file_name().is_some_and(|n| n == "sandpit-agent") {
        if let Err(e) = sandpit_agent_run() { eprintln!("{e}"); std::process::exit(1) }
        return;
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "__sandbox-init") {
        std::process::exit(sandpit_runtime::init_main());
    }
    tracing_subscriber_init();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        sandpit_server::serve(sandpit_server::ServeConfig {
            listen: "127.0.0.1:7999".parse().unwrap(),
            data_dir: "/tmp/smoke/data".into(),
            insecure_no_auth: true,
            max_timeout_secs: 3600,
            self_exe: std::env::current_exe().unwrap(),
        }).await.unwrap();
    });
}
fn sandpit_agent_run() -> Result<(), String> { sandpit_agent::run_from_env().map_err(|e| e.to_string()) }
fn tracing_subscriber_init() {}
