//! The config's tests: loading, environment overrides, validation and what is printed.

use super::*;

fn no_env() -> Vec<(String, String)> {
    Vec::new()
}

#[test]
fn defaults_are_valid() {
    let config = Config::from_toml("", no_env()).unwrap();
    assert_eq!(config.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(config.upstreams[0].base_url, "https://api.openai.com/v1");
    assert!(!config.auth_enabled());
}

#[test]
fn repo_config_file_is_valid_and_documents_every_key() {
    let text = include_str!("../config.toml");
    let config = Config::from_toml(text, no_env()).unwrap();
    // Every key of the defaults appears in the documented file (commented or not).
    let defaults = toml::to_string(&RawConfig::default()).unwrap();
    for line in defaults.lines() {
        if let Some((key, _)) = line.split_once(" = ") {
            let documented =
                text.contains(&format!("{key} =")) || text.contains(&format!("[[{key}]]"));
            assert!(documented, "config.toml lacks `{key}`");
        }
    }
    assert!(config.default_upstream.is_some());
}

#[test]
fn serving_threads_are_one_per_core_unless_set() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = |toml: &str, env: Vec<(String, String)>| {
        Config::from_toml(toml, env).map(|config| config.server.threads)
    };
    assert_eq!(threads("", no_env()).unwrap(), cores);
    assert_eq!(threads("[server]\nthreads = 0\n", no_env()).unwrap(), cores);
    assert_eq!(threads("[server]\nthreads = 3\n", no_env()).unwrap(), 3);
    let env = vec![("CTXPROXY_SERVER_THREADS".to_owned(), "5".to_owned())];
    assert_eq!(threads("", env).unwrap(), 5);
    let error = threads("[server]\nthreads = 5000\n", no_env()).unwrap_err();
    assert!(error.to_string().contains("server.threads"), "{error}");
}

#[test]
fn the_vocabularies_loaded_at_start_are_those_of_the_routes() {
    let config = Config::from_toml("", no_env()).unwrap();
    assert_eq!(config.encodings(), [Encoding::O200kBase]);
    let text = "[upstream]\nbase_url = \"\"\n\
        [[routes]]\nname = \"old\"\nmodels = [\"gpt-4\", \"gpt-3.5-*\"]\nbase_url = \"http://h/v1\"\n\
        [[routes]]\nname = \"local\"\nmodels = [\"llama-*\"]\nbase_url = \"http://l/v1\"\n\
        tokenizer = \"cl100k_base\"\n";
    let config = Config::from_toml(text, no_env()).unwrap();
    assert_eq!(config.encodings(), [Encoding::Cl100kBase]);
}

#[test]
fn guards_are_global_and_a_route_replaces_them_whole() {
    let text = "[continuation]\nenabled = true\nmax_attempts = 2\n\
        [[routes]]\nname = \"local\"\nmodels = [\"llama-*\"]\nbase_url = \"http://127.0.0.1:9/v1\"\n\
        [routes.continuation]\nmax_attempts = 5\n\
        [routes.action_check]\nenabled = true\n";
    let config = Config::from_toml(text, no_env()).unwrap();
    let (global, route) = (&config.upstreams[0].guards, &config.upstreams[1].guards);
    assert!(global.continuation.enabled && global.continuation.max_attempts == 2);
    assert!(!global.action_check.enabled);
    // The route's table replaces the global one: its `enabled` is the default (off).
    assert!(!route.continuation.enabled && route.continuation.max_attempts == 5);
    assert!(route.action_check.enabled && !route.reinforcement.enabled);
    let invalid = |text: &str| match Config::from_toml(text, no_env()) {
        Err(ConfigError::Invalid { key, .. }) => key,
        other => panic!("expected an invalid key, got {other:?}"),
    };
    assert_eq!(
        invalid("[continuation]\nenabled = true\nmax_attempts = 0\n"),
        "continuation.max_attempts"
    );
    assert_eq!(
        invalid(
            "[[routes]]\nmodels = [\"x\"]\nbase_url = \"http://h/v1\"\n[routes.reinforcement]\nenabled = true\ntext = \" \"\n"
        ),
        "routes[0].reinforcement.text"
    );
}

#[test]
fn typos_in_levels_and_inverted_thresholds_are_refused() {
    let key_of = |text: &str| match Config::from_toml(text, no_env()) {
        Err(ConfigError::Invalid { key, .. }) => key,
        other => panic!("expected an invalid key, got {other:?}"),
    };
    assert_eq!(key_of("[log]\nlevel = \"infoo\"\n"), "log.level");
    assert_eq!(
        key_of("[pipeline.window]\ncontinuity_low = 0.5\ncontinuity_high = 0.2\n"),
        "pipeline.window.continuity_low"
    );
    assert!(Config::from_toml("[log]\nlevel = \"debug,hyper=warn\"\n", no_env()).is_ok());
}

#[test]
fn env_overrides_values_with_types() {
    let env = vec![
        (
            "CTXPROXY_UPSTREAM_BASE_URL".to_owned(),
            "http://127.0.0.1:9000/v1".to_owned(),
        ),
        (
            "CTXPROXY_SERVER_CONCURRENCY_LIMIT".to_owned(),
            "7".to_owned(),
        ),
        ("PATH".to_owned(), "/bin".to_owned()),
        (
            "CTXPROXY_PIPELINE_BUDGET_MAX_TOKENS".to_owned(),
            "3000".to_owned(),
        ),
        ("CTXPROXY_PIPELINE_MODE".to_owned(), "observe".to_owned()),
    ];
    let config = Config::from_toml("[server]\nconcurrency_limit = 3\n", env).unwrap();
    assert_eq!(config.upstreams[0].base_url, "http://127.0.0.1:9000/v1");
    assert_eq!(config.server.concurrency_limit, 7);
    assert_eq!(config.pipeline.budget.max_tokens, 3000);
    assert_eq!(config.pipeline.mode, crate::pipeline::Mode::Observe);
}

#[test]
fn errors_name_the_key() {
    let cases = [
        ("[server]\nlisten = \"nope\"", "server.listen"),
        (
            "[server]\nmax_body_bytes = \"big\"",
            "server.max_body_bytes",
        ),
        ("[server]\nlistne = \"x\"", "listne"),
        ("[upstream]\nbase_url = \"ftp://x\"", "upstream.base_url"),
        (
            "[[routes]]\nmodels = []\nbase_url = \"http://x\"",
            "routes[0].models",
        ),
        (
            "[[auth.keys]]\nsha256 = \"abc\"\ntenant = \"t\"",
            "auth.keys[0].sha256",
        ),
        ("[log]\nformat = \"xml\"", "log.format"),
        ("[tools]\nmax_expansions = 0", "tools.max_expansions"),
        (
            "[tools]\nmax_expansions = 4294967295",
            "tools.max_expansions",
        ),
        (
            "[upstream]\napi_key_env = \"CTXPROXY_TEST_SURELY_UNSET_VAR\"",
            "upstream.api_key_env",
        ),
    ];
    for (text, key) in cases {
        let err = Config::from_toml(text, no_env()).unwrap_err().to_string();
        assert!(
            err.contains(key),
            "{text:?} gave {err:?}, expected key {key}"
        );
    }
    let err = Config::from_toml("", vec![("CTXPROXY_NOPE_X".into(), "1".into())]).unwrap_err();
    assert!(err.to_string().contains("CTXPROXY_NOPE_X"));
    // Not overrides: the config path, the tests' variables, Kubernetes service links.
    let others = [
        ("CTXPROXY_CONFIG", "/etc/ctxproxy/config.toml"),
        ("CTXPROXY_TEST_PYTHON", "/usr/bin/python3"),
        ("CTXPROXY_SERVICE_HOST", "10.0.0.7"),
        ("CTXPROXY_PORT", "tcp://10.0.0.7:8080"),
        ("CTXPROXY_PORT_8080_TCP_PORT", "8080"),
    ];
    let env: Vec<(String, String)> = others
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    assert!(Config::from_toml("", env).is_ok());
}

#[test]
fn routes_pick_the_first_matching_pattern_then_the_default() {
    let text = r#"
        [[routes]]
        name = "local"
        models = ["llama-*", "qwen?"]
        base_url = "http://127.0.0.1:11434/v1/"
    "#;
    let config = Config::from_toml(text, no_env()).unwrap();
    assert_eq!(config.upstream_for_model("llama-3.1-8b"), Some(1));
    assert_eq!(config.upstream_for_model("qwen3"), Some(1));
    assert_eq!(config.upstream_for_model("gpt-4o"), Some(0));
    assert_eq!(config.upstreams[1].base_url, "http://127.0.0.1:11434/v1");
    let no_default = Config::from_toml("[upstream]\nbase_url = \"\"", no_env()).unwrap();
    assert_eq!(no_default.upstream_for_model("gpt-4o"), None);
}

#[test]
fn secrets_do_not_print() {
    let secret = Secret::new("sk-live-123");
    assert_eq!(format!("{secret} {secret:?}"), "*** ***");
}
