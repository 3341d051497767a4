//! Golden tests: each fixture in tests/fixtures/pipeline/ runs through the whole pipeline and
//! the rewritten request with the stage reports is compared with its reviewed snapshot in
//! tests/snapshots/. Review changes with `cargo insta review` (never accept blindly).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ctxproxy::openai::ChatRequest;
use ctxproxy::pipeline::{self, Memo, PipelineConfig};
use ctxproxy::tokens::{Encoding, TokenCounter};
use serde_json::{Value, json};

fn rewrite(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/pipeline/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let request: ChatRequest = serde_json::from_value(fixture["request"].clone()).unwrap();
    let budget = fixture["budget"].as_u64().unwrap() as usize;
    let counter = TokenCounter::new(Encoding::O200kBase);
    let rewrite = pipeline::run(
        &request,
        &pipeline::Env {
            config: &PipelineConfig::default(),
            counter: &counter,
            memo: &Memo::default(),
            budget,
            sticky_categories: &[],
            reinforcement: None,
        },
    );
    json!({"report": rewrite.report, "request": rewrite.request})
}

macro_rules! golden {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            insta::assert_json_snapshot!(stringify!($name), rewrite(stringify!($name)));
        }
    )*};
}

golden!(
    system_consolidation,
    long_chat_with_facts,
    github_json_tool_result,
    text_tool_results,
    topic_shift,
    budget_ladder,
    agent_proposal_ledger,
);
