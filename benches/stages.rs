//! Where a rewrite's time goes, step by step, on real-sized requests (issue 34): parsing the
//! body, counting its tokens, each stage alone on the input it really gets, the budget's ladder,
//! and writing the rewrite out. `cold`: fresh token-count cache and memo (a conversation the
//! process never saw; the tokenizer's per-thread piece cache stays warm, as in a running
//! proxy); `warm`: the same stage run once before on the same input.
//!
//! Two requests: a 100-turn customer-service conversation (~160 KB, many small messages) and an
//! autonomous agent's 30 steps (~200 KB, few messages, large JSON results).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};

// The allocator the binary runs with (src/main.rs), so that the times are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ctxproxy::openai::ChatRequest;
use ctxproxy::pipeline::{self, Memo, PipelineConfig, StageName};
use ctxproxy::synthetic;
use ctxproxy::tokens::{Encoding, TokenCounter};

fn fresh_caches() -> (TokenCounter, Memo) {
    (TokenCounter::new(Encoding::O200kBase), Memo::default())
}

fn env<'a>(config: &'a PipelineConfig, caches: &'a (TokenCounter, Memo)) -> pipeline::Env<'a> {
    env_with_budget(config, caches, config.budget.max_tokens)
}

fn env_with_budget<'a>(
    config: &'a PipelineConfig,
    caches: &'a (TokenCounter, Memo),
    budget: usize,
) -> pipeline::Env<'a> {
    pipeline::Env {
        config,
        counter: &caches.0,
        memo: &caches.1,
        budget,
        sticky_categories: &[],
        reinforcement: None,
        remembered: None,
    }
}

/// Times `run` on fresh caches (cold) and on caches it already ran with (warm).
fn cold_and_warm(c: &mut Criterion, name: &str, run: impl Fn(&(TokenCounter, Memo)) + Copy) {
    c.bench_function(&format!("{name}_cold"), |b| {
        b.iter_batched(
            fresh_caches,
            |caches| {
                run(&caches);
                // Returned, so that dropping the caches is not timed.
                caches
            },
            BatchSize::PerIteration,
        )
    });
    let warm = fresh_caches();
    run(&warm);
    c.bench_function(&format!("{name}_warm"), |b| b.iter(|| run(&warm)));
}

fn steps_of(c: &mut Criterion, label: &str, request: &ChatRequest) {
    let bytes = serde_json::to_vec(request).unwrap();
    let name = format!("{label}_{}KB", bytes.len() / 1024);
    let config = PipelineConfig::default();

    c.bench_function(&format!("{name}/parse"), |b| {
        b.iter_batched(
            Memo::default,
            |memo| {
                std::hint::black_box(ChatRequest::parse_with(&bytes, &memo).unwrap());
                memo
            },
            BatchSize::PerIteration,
        )
    });
    cold_and_warm(c, &format!("{name}/count"), |caches| {
        std::hint::black_box(caches.0.request(request));
    });

    // Each stage on what the stages before it left (the first pass of a whole rewrite).
    let snapshots = pipeline::stage_snapshots(request, &env(&config, &fresh_caches()));
    let mut input = request.clone();
    for stage in [
        StageName::System,
        StageName::Window,
        StageName::Tools,
        StageName::Compact,
    ] {
        let stage_input = input.clone();
        let run = |caches: &(TokenCounter, Memo)| {
            let output = pipeline::run_stage(
                stage,
                &stage_input,
                &request.messages,
                &env(&config, caches),
            );
            std::hint::black_box(output.expect("one of the four stages"));
        };
        cold_and_warm(c, &format!("{name}/stage_{}", stage.as_str()), run);
        if let Some((_, after)) = snapshots.iter().find(|(s, _)| *s == stage) {
            input = after.clone();
        }
    }

    // A whole rewrite (no prefix decisions) within a budget the first pass meets, and within
    // one that makes the ladder run its steps.
    let mut whole = config.clone();
    whole.clear_at_least_tokens = 0;
    for (budget_name, budget) in [("roomy", 10_000_000), ("tight", 1_500)] {
        cold_and_warm(c, &format!("{name}/whole_{budget_name}"), |caches| {
            let env = env_with_budget(&whole, caches, budget);
            std::hint::black_box(pipeline::run(request, &env));
        });
    }

    let rewrite = pipeline::run(request, &env(&config, &fresh_caches()));
    c.bench_function(&format!("{name}/serialize"), |b| {
        b.iter(|| std::hint::black_box(serde_json::to_vec(&rewrite.request).unwrap()))
    });
}

fn stages(c: &mut Criterion) {
    steps_of(
        c,
        "conversation_100",
        &synthetic::conversation(100).unwrap(),
    );
    steps_of(c, "agent_30", &synthetic::autonomous_agent(30).unwrap());
}

criterion_group!(benches, stages);
criterion_main!(benches);
