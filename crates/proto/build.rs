fn main() {
    if let Err(err) = connectrpc_build::Config::new()
        .files(&[
            "proto/process/process.proto",
            "proto/filesystem/filesystem.proto",
        ])
        .includes(&["proto/"])
        .include_file("_connectrpc.rs")
        .compile()
    {
        // protoc comes from the project's setup script; say so rather than panic obscurely.
        eprintln!(
            "sandpit-proto: code generation failed (is protoc installed? run scripts/setup.sh): {err:#}"
        );
        std::process::exit(1);
    }
}
