//! Golden tests: each fixture in tests/fixtures/pipeline/ runs through the whole pipeline and
//! the rewritten request with the stage reports is compared with its reviewed snapshot in
//! tests/snapshots/. Review changes with `cargo insta review` (never accept blindly).
//!
//! The stage goldens rewrite each request whole (`clear_at_least_tokens = 0`) and filter every
//! tool block (`min_tool_tokens = 0`); the `prefix_*`
//! goldens run the default config, where a request's rewrite is the conversation's last whole
//! rewrite with the later messages appended unless rebuilding pays (`pipeline/prefix.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ctxproxy::openai::ChatRequest;
use ctxproxy::pipeline::{self, Memo, PipelineConfig};
use ctxproxy::responses;
use ctxproxy::tokens::{Encoding, TokenCounter};
use serde_json::{Value, json};

fn rewrite(name: &str, config: &PipelineConfig) -> Value {
    let path = format!(
        "{}/tests/fixtures/pipeline/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let request: ChatRequest = serde_json::from_value(fixture["request"].clone()).unwrap();
    let rewrite = run(&request, config, &fixture);
    json!({"report": rewrite.report, "request": rewrite.request})
}

/// The pipeline over `request`, with the fixture's budget and nothing remembered.
fn run(request: &ChatRequest, config: &PipelineConfig, fixture: &Value) -> pipeline::Rewrite {
    let budget = fixture["budget"].as_u64().unwrap() as usize;
    let counter = TokenCounter::new(Encoding::O200kBase);
    pipeline::run(
        request,
        &pipeline::Env {
            config,
            counter: &counter,
            memo: &Memo::default(),
            budget,
            sticky_categories: &[],
            reinforcement: None,
            remembered: None,
        },
    )
}

/// A Responses API fixture (tests/fixtures/responses/) read as chat, rewritten by the pipeline
/// with its tools whole and no recall tool (what these files are about is the items: reasoning
/// pairs, compaction, hosted calls), and written back.
fn rewrite_responses(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/responses/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let body = fixture["request"].as_object().unwrap().clone();
    let (chat, converted) = responses::to_chat(body).unwrap();
    let mut config = whole();
    config.tools.enabled = false;
    config.compact.recall = false;
    let rewrite = run(&chat, &config, &fixture);
    let sent = responses::from_chat(&converted, &rewrite.request);
    assert!(responses::reasoning_in_place(
        &converted.client_body(),
        &sent
    ));
    json!({"report": rewrite.report, "compacted_items": converted.compacted_items, "request": sent})
}

#[test]
fn responses_agent_reasoning() {
    insta::assert_json_snapshot!(
        "responses_agent_reasoning",
        rewrite_responses("agent_reasoning")
    );
}

/// Every request rewritten whole, and every tool block filtered (the fixtures' are small), with
/// one keyword enough to select a category (the fixtures' user messages are short).
fn whole() -> PipelineConfig {
    let mut config = PipelineConfig {
        clear_at_least_tokens: 0,
        ..PipelineConfig::default()
    };
    config.tools.min_tool_tokens = 0;
    config.tools.min_stub_tokens = 0;
    config.tools.min_score = 1.0;
    config
}

macro_rules! golden {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            insta::assert_json_snapshot!(stringify!($name), rewrite(stringify!($name), &whole()));
        }
    )*};
}

macro_rules! prefix_golden {
    ($($name:ident: $fixture:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            let config = PipelineConfig::default();
            insta::assert_json_snapshot!(stringify!($name), rewrite(stringify!($fixture), &config));
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
    tools_defined_where_called,
    database_results_recall,
);

prefix_golden!(
    prefix_long_chat_appended: long_chat_with_facts,
    prefix_agent_appended: agent_proposal_ledger,
    prefix_over_budget_rebuilt: budget_ladder,
);
