//! One chat request, parsed: the request and where it goes ([`ChatCall::parse`]), and its
//! rewrite ([`ChatCall::rewrite`], [`ChatCall::run_pipeline`]). The later phases are in
//! `send.rs`; the bookkeeping of every phase goes to the [`CallLog`].

use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::http::request::Parts;
use bytes::Bytes;

use super::call_log::{CallLog, TokenCounts};
use crate::bill::{Prompt, cached_of};
use crate::conversation::{client_conversation_id, conversation_id};
use crate::cores;
use crate::error::ProxyError;
use crate::metrics::{BudgetOutcome, ChainToolsOutcome, ChatLabels};
use crate::openai::{Api, ChatRequest, Tool};
use crate::pipeline::recall::{self, Mark};
use crate::pipeline::tools::chain::ChainTools;
use crate::pipeline::tools::inline;
use crate::pipeline::{self, Mode, OnExceed, PrefixState, Rewrite, StageName, tools};
use crate::responses;
use crate::server::meter::Saving;
use crate::server::{
    RequestContext, SharedState, chain_tools, learned, prefix_state, read_body, recall_marks,
    scope, sticky,
};
use crate::tokens::TokenCounter;
use crate::upstream::Upstream;

pub const X_CTXPROXY_MODE: &str = "x-ctxproxy-mode";
pub const X_CTXPROXY_BUDGET: &str = "x-ctxproxy-budget";

/// A body at least this large is rewritten on the rewrite threads (`AppState::rewriters`)
/// when its serving thread has other work (`cores::shared`): a cold conversation of that size
/// takes 1-10 ms, which that work would wait for. Otherwise it is rewritten where it arrived:
/// the handoff costs 50-150 µs (two threads woken), much of a small or memoized rewrite.
const REWRITE_ELSEWHERE_BYTES: usize = 32 * 1024;

/// Which endpoint a chat request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// `/v1/chat/completions`: the mode comes from `X-Ctxproxy-Mode` or the config.
    Chat,
    /// `/v1/ctxproxy/explain`: always the optimized rewrite, of a chat or a Responses body.
    Explain,
    /// `/v1/responses`: a Responses API body, read as a chat request; the mode as for chat.
    Responses,
}

/// A parsed chat request and everything decided from it before the pipeline runs.
pub struct ChatCall<'a> {
    pub state: &'a SharedState,
    pub parts: Parts,
    /// The client's body, as received.
    pub bytes: Bytes,
    pub chat: Arc<ChatRequest>,
    /// A Responses API body, read as `chat`: what writing its rewrite back needs.
    pub responses: Option<Arc<responses::Converted>>,
    pub upstream: &'a Arc<Upstream>,
    pub mode: Mode,
    /// Whose caches and conversation state these are (see `scope.rs`).
    pub scope: String,
    /// The conversation (mode `observe` or `optimize`): its prefix state, and its sticky tool
    /// categories when [`ChatCall::uses_tool_state`].
    pub conversation: Option<String>,
    /// Its `model` and `tenant` metric labels.
    pub labels: ChatLabels,
}

/// What goes upstream after the rewrite phase.
pub struct Outgoing {
    pub body: Bytes,
    /// What a rewritten request is priced against when its usage arrives.
    pub saving: Option<Saving>,
    /// The tokens of the rewrite sent; `None` when the client's bytes go.
    pub sent_tokens: Option<usize>,
    /// The rewrite, when it sends tools as stubs or offers `ctxproxy_recall` (an answer may
    /// call one: `expand`).
    pub with_stubs: Option<ChatRequest>,
    /// Where the conversation's recalls were answered: a new one is added to them.
    pub recalls: Vec<Mark>,
    /// The block a stored Response's request sends in place of the client's tools: what a
    /// request chained on it sends again (`chain_tools`).
    pub chain_tools: Option<ChainTools>,
    /// Of a chained request, the tools its chain's history defines (a call is checked, not
    /// asked again).
    pub chain_defined: Vec<String>,
}

/// The pipeline's rewrite, and the conversation's state in the store before it.
pub struct Pipelined {
    pub rewrite: Rewrite,
    pub remembered: Option<PrefixState>,
    /// Where the conversation's recalls were answered (put back into `rewrite`).
    pub recalls: Vec<Mark>,
    /// The block of the chain a chained request goes on (`None` otherwise, or not known).
    pub chain: Option<ChainTools>,
}

/// What the store is asked of a conversation before a request's rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StateReads {
    /// Where the conversation's rewrite was last rebuilt: only a request whose history shows
    /// an earlier one has a point to resume from.
    prefix: bool,
    /// Where its recalls were answered: put back after an earlier request, or into a retry of
    /// a first request whose answer recalled, which only a request that may be offered the
    /// recall tool is (a recall pair in a request without tools would call a tool it lacks).
    recall_marks: bool,
}

impl StateReads {
    fn of(chat: &ChatRequest) -> StateReads {
        let earlier = pipeline::prefix::has_earlier_point(&chat.messages);
        let client_tools = chat.tools.get().map_or(&[][..], Vec::as_slice);
        StateReads {
            prefix: earlier,
            recall_marks: earlier || recall::can_offer(chat, client_tools),
        }
    }
}

/// Reads a chat body, bounded by `[server] max_body_bytes`.
pub async fn read(state: &SharedState, request: Request) -> Result<(Parts, Bytes), ProxyError> {
    let (parts, body) = request.into_parts();
    let bytes = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    Ok((parts, bytes))
}

impl<'a> ChatCall<'a> {
    /// Parses the body, routes its model and picks the mode.
    pub fn parse(
        state: &'a SharedState,
        context: &RequestContext,
        parts: Parts,
        bytes: Bytes,
        entry: Entry,
    ) -> Result<ChatCall<'a>, ProxyError> {
        let is_responses = match entry {
            Entry::Chat => false,
            Entry::Explain => responses::is_responses_body(&bytes),
            Entry::Responses => true,
        };
        let (chat, responses) = if is_responses {
            let (chat, converted) = responses::to_chat(responses::parse(&bytes)?)?;
            (chat, Some(Arc::new(converted)))
        } else {
            (ChatRequest::parse_with(&bytes, &state.memo)?, None)
        };
        let upstream = route(state, &chat.model)?;
        let mode = match entry {
            Entry::Chat | Entry::Responses => mode_of(&parts.headers, state.config.pipeline.mode)?,
            Entry::Explain => Mode::Optimize,
        };
        let scope = scope::of(&state.config, &context.tenant, &parts);
        let conversation =
            (mode != Mode::Off).then(|| conversation_id(&scope, &parts.headers, &chat));
        let labels = ChatLabels {
            model: state.model_labels.label(&chat.model).to_owned(),
            tenant: context.tenant.as_str().to_owned(),
        };
        Ok(ChatCall {
            state,
            parts,
            bytes,
            chat: Arc::new(chat),
            responses,
            upstream,
            mode,
            scope,
            conversation,
            labels,
        })
    }

    /// Which API the request speaks.
    pub fn api(&self) -> Api {
        match self.responses {
            Some(_) => Api::Responses,
            None => Api::Chat,
        }
    }

    /// Whether the proxy may answer a call to a stub or to `ctxproxy_recall` without the client
    /// telling: always on chat, and on the Responses API unless the answer streams under an id
    /// the upstream keeps. A streamed expansion keeps the first answer's id (the SDKs refuse a
    /// stream whose Response changes), and with `store` true that stored Response holds the call
    /// to the stub: a client chaining on it would answer a call the upstream never saw. Nor can
    /// it when the Response runs in the background: its answer is read later, from the
    /// upstream. Such a request sends its tools whole, with no recall tool.
    pub fn expansion_hidden(&self) -> bool {
        self.responses
            .as_ref()
            .is_none_or(|c| !c.background() && (!self.chat.is_stream() || !c.stored()))
    }

    /// Whether the pipeline may rewrite the request: any chat request, a Responses body whose
    /// history the client sent whole ([`responses::Converted::rewritable`]).
    pub fn rewritable(&self) -> bool {
        self.responses.as_ref().is_none_or(|c| c.rewritable())
    }

    /// Whether this request reads the conversation's sticky tool categories (a Responses
    /// request's answer does not write them: it reads chat answers, see `send.rs`).
    pub fn uses_tool_state(&self) -> bool {
        self.mode != Mode::Off
            && self.state.config.pipeline.tools.enabled
            && self.chat.tools.get().is_some_and(|t| !t.is_empty())
    }

    /// Writes the parse to the log: labels, and what the recording keeps of the request.
    pub fn log_parsed(&self, log: &mut CallLog) {
        log.parsed(&self.labels, &self.chat.model, self.mode, || {
            // The client's own conversation id when it sent one, else the derived one.
            let headers = &self.parts.headers;
            client_conversation_id(headers)
                .or_else(|| self.conversation.clone())
                .unwrap_or_else(|| conversation_id(&self.scope, headers, &self.chat))
        });
    }

    /// The rewrite phase: the pipeline, the budget's verdict and their metrics, and the body to
    /// send. A request over its budget with `on_exceed = "reject"` ends here.
    pub async fn rewrite(&self, log: &mut CallLog) -> Result<Outgoing, ProxyError> {
        let unchanged = Outgoing {
            body: self.bytes.clone(),
            saving: None,
            sent_tokens: None,
            with_stubs: None,
            recalls: Vec::new(),
            chain_tools: None,
            chain_defined: Vec::new(),
        };
        if self.mode == Mode::Off || !self.rewritable() {
            return Ok(unchanged);
        }
        let started = Instant::now();
        let Pipelined {
            rewrite,
            remembered,
            recalls,
            chain,
        } = self.run_pipeline().await?;
        if let (Some(conversation), Some(prefix)) = (&self.conversation, rewrite.remember)
            && Some(prefix) != remembered
        {
            prefix_state::save(self.state, conversation, prefix);
        }
        log.rewritten(&rewrite.report, started);
        let report = &rewrite.report;
        let metrics = &self.state.metrics;
        let budget = &self.state.config.pipeline.budget;
        let over_budget = budget.enabled && !report.fits;
        let optimize = self.mode == Mode::Optimize;
        if optimize && self.chained_on().is_some() {
            let applied = report
                .stage(StageName::Tools)
                .and_then(|stage| stage.details.tools())
                .is_some_and(|tools| tools.reason == Some(tools::Reason::Chain));
            let outcome = match (&chain, applied) {
                (_, true) => ChainToolsOutcome::Applied,
                (None, false) => ChainToolsOutcome::Missing,
                (Some(_), false) => ChainToolsOutcome::Whole,
            };
            metrics.count_chain_tools(outcome, &log.labels);
        }
        if optimize {
            if over_budget && budget.on_exceed == OnExceed::Reject {
                metrics.count_budget(BudgetOutcome::Rejected, &log.labels);
                return Err(ProxyError::ContextBudgetExceeded {
                    budget: report.budget,
                    tokens_before: report.tokens_before,
                    tokens_after: report.tokens_after,
                });
            }
            let outcome = if over_budget {
                BudgetOutcome::OverFloor
            } else {
                BudgetOutcome::Fit
            };
            metrics.count_rewrite_sent(&rewrite, outcome, &log.labels);
        } else {
            metrics.count_rewrite_observed(&rewrite, &log.labels);
        }
        log.counts = Some(TokenCounts {
            before: report.tokens_before,
            // Observe mode sends the original: nothing was saved.
            after: if optimize {
                report.tokens_after
            } else {
                report.tokens_before
            },
            would_send: (!optimize).then_some(report.tokens_after),
            over_budget: report
                .over_budget
                .filter(|_| optimize)
                .map(|over| over.tokens_over),
        });
        if !(optimize && rewrite.changed()) {
            // Nothing changed, or observe mode: the client's own bytes go upstream.
            return Ok(unchanged);
        }
        let body = match &self.responses {
            Some(converted) => responses::write(converted, &rewrite.request),
            None => serde_json::to_vec(&rewrite.request),
        }
        .map(Bytes::from)
        .map_err(|e| ProxyError::Internal(e.to_string()))?;
        log.sent_rewritten(&body);
        let saving = self.saving_of(report);
        let stubs = report
            .stage(StageName::Tools)
            .filter(|stage| stage.applied)
            .and_then(|stage| stage.details.tools())
            .and_then(|tools| tools.stubs)
            .is_some_and(|stubs| stubs > 0);
        let recall = rewrite
            .request
            .tools
            .get()
            .is_some_and(|t| recall::offered(t));
        let chain_defined = chain.map(ChainTools::into_defined).unwrap_or_default();
        let chain_tools = self.chain_tools_of(&rewrite.request, &chain_defined);
        Ok(Outgoing {
            body,
            saving,
            sent_tokens: Some(report.tokens_after),
            with_stubs: (stubs || recall).then_some(rewrite.request),
            recalls,
            chain_tools,
            chain_defined,
        })
    }

    /// Runs the pipeline with the conversation's sticky categories and prefix state, timing it.
    /// Reads the store, never writes it.
    pub async fn run_pipeline(&self) -> Result<Pipelined, ProxyError> {
        let state = self.state;
        let reads = StateReads::of(&self.chat);
        let conversation = async {
            let Some(conversation) = &self.conversation else {
                return (None, Vec::new());
            };
            tokio::join!(
                async {
                    if reads.prefix {
                        prefix_state::load(state, conversation).await
                    } else {
                        None
                    }
                },
                async {
                    if reads.recall_marks {
                        recall_marks::load(state, conversation).await
                    } else {
                        Vec::new()
                    }
                }
            )
        };
        // A request chained on a stored Response sends the block its request sent.
        let chain = async {
            match self.chained_on() {
                Some(previous) => chain_tools::load(state, &self.scope, previous).await,
                None => None,
            }
        };
        // What another replica learned of the upstream's template (rarely asks the store).
        let ((remembered, recalls), sticky, (), chain) = tokio::join!(
            conversation,
            self.sticky_categories(),
            learned::refresh(state, self.upstream),
            chain
        );
        let config = if self.expansion_hidden() {
            self.upstream.pipeline()
        } else {
            self.upstream.tools_whole_pipeline()
        };
        let budget = budget_of(&self.parts.headers, config.budget.max_tokens)?;
        // A chained Responses request: its history is upstream, only what it sends is seen.
        let chained = self.responses.as_ref().is_some_and(|c| c.chained());
        let rewrite = {
            let (state, upstream, chat) = (state.clone(), self.upstream.clone(), self.chat.clone());
            let config = config.clone();
            move || {
                let counter = state
                    .tokenizers
                    .for_model(&chat.model, upstream.config.tokenizer);
                let started = Instant::now();
                let env = pipeline::Env {
                    config: &config,
                    counter,
                    memo: &state.memo,
                    budget,
                    sticky_categories: &sticky,
                    reinforcement: Some(&upstream.config.guards.reinforcement),
                    remembered,
                };
                let mut rewrite = if chained {
                    pipeline::seen::run(&chat, &env, chain.as_ref())
                } else {
                    pipeline::run(&chat, &env)
                };
                if !recalls.is_empty() && !chained {
                    put_back(&mut rewrite, &chat, &recalls, counter);
                }
                (rewrite, recalls, chain, started.elapsed())
            }
        };
        // A large body's rewrite may take milliseconds: off a serving thread that has other
        // work, which goes on meanwhile.
        let elsewhere = self.bytes.len() >= REWRITE_ELSEWHERE_BYTES && cores::shared();
        let (rewrite, recalls, chain, took) = if elsewhere {
            state
                .rewriters
                .run(rewrite)
                .await
                .map_err(|e| ProxyError::Internal(e.to_string()))?
        } else {
            rewrite()
        };
        state
            .metrics
            .pipeline_duration
            .with_label_values(&[&self.labels.model, &self.labels.tenant])
            .observe(took.as_secs_f64());
        Ok(Pipelined {
            rewrite,
            remembered,
            recalls,
            chain,
        })
    }

    /// The stored Response whose chain's block this request looks up: the one it chains on
    /// (`previous_response_id`), when it offers tools to a pipeline that reads tool state.
    fn chained_on(&self) -> Option<&str> {
        let previous = self
            .responses
            .as_ref()
            .and_then(|c| c.previous_response_id());
        previous.filter(|_| self.uses_tool_state())
    }

    /// What a stored Response's request leaves its chain when it sends `sent` (its final form,
    /// after any re-ask), its chain's history defining `earlier` already: the block, when it is
    /// not the client's tools.
    pub fn chain_tools_of(&self, sent: &ChatRequest, earlier: &[String]) -> Option<ChainTools> {
        let tools = sent.tools.get().map_or(&[][..], Vec::as_slice);
        self.chain_tools_with(tools, inline::defined_in(&sent.messages), earlier)
    }

    /// The same, from the tools sent and the names the messages sent define.
    pub fn chain_tools_with(
        &self,
        tools: &[Tool],
        defined: impl IntoIterator<Item = String>,
        earlier: &[String],
    ) -> Option<ChainTools> {
        if !self.responses.as_ref().is_some_and(|c| c.stored()) {
            return None;
        }
        let mut defined: Vec<String> = earlier.iter().cloned().chain(defined).collect();
        defined.sort();
        defined.dedup();
        ChainTools::of(&self.chat, tools, defined)
    }

    /// The request's token budget, when the budget applies.
    pub fn budget(&self) -> Option<usize> {
        let budget = &self.state.config.pipeline.budget;
        budget
            .enabled
            .then(|| budget_of(&self.parts.headers, budget.max_tokens).unwrap_or(budget.max_tokens))
    }

    /// The conversation's sticky categories: those stored after its last tool-using turn (of a
    /// conversation the client names with `X-Conversation-Id`), plus those of the previous turn
    /// in the history the client sent (so a store outage loses nothing for clients that send
    /// their whole history).
    async fn sticky_categories(&self) -> Vec<String> {
        let Some(conversation) = self
            .conversation
            .as_deref()
            .filter(|_| self.uses_tool_state())
        else {
            return Vec::new();
        };
        let state = self.state;
        // Only a conversation the client names has a past of its own: one named by its first
        // messages is shared by every session that starts the same way, and a retry of a first
        // request must be sent as the first attempt was.
        let mut categories = if client_conversation_id(&self.parts.headers).is_some() {
            sticky::load(state, conversation).await
        } else {
            Vec::new()
        };
        categories.extend(tools::previous_turn_categories(
            &self.chat,
            &state.config.pipeline,
            &state.memo,
        ));
        categories.sort();
        categories.dedup();
        categories
    }

    /// What a rewritten request is priced against when its usage arrives (`meter.rs`): the
    /// client's request, cached as far as its previous request reached (the provider's rule),
    /// and the tokens sent. `None` for a model without a price.
    fn saving_of(&self, report: &pipeline::PipelineReport) -> Option<Saving> {
        let price = self.state.config.price_of(&self.chat.model)?;
        let previous = report.prefix.as_ref().and_then(|p| p.previous_tokens);
        Some(Saving {
            original: Prompt {
                tokens: report.tokens_before,
                cached: previous.map_or(0, |tokens| cached_of(tokens.min(report.tokens_before))),
            },
            sent_tokens: report.tokens_after,
            price,
        })
    }
}

fn route<'a>(state: &'a SharedState, model: &str) -> Result<&'a Arc<Upstream>, ProxyError> {
    state
        .config
        .upstream_for_model(model)
        .and_then(|index| state.upstreams.get(index))
        .ok_or_else(|| ProxyError::ModelNotRouted {
            model: model.to_owned(),
        })
}

fn mode_of(headers: &HeaderMap, default: Mode) -> Result<Mode, ProxyError> {
    match headers.get(X_CTXPROXY_MODE) {
        None => Ok(default),
        Some(value) => {
            value
                .to_str()
                .ok()
                .and_then(Mode::parse)
                .ok_or_else(|| ProxyError::InvalidHeader {
                    header: "X-Ctxproxy-Mode",
                    message: "expected off, observe or optimize".into(),
                })
        }
    }
}

fn budget_of(headers: &HeaderMap, default: usize) -> Result<usize, ProxyError> {
    match headers.get(X_CTXPROXY_BUDGET) {
        None => Ok(default),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&b| b > 0)
            .ok_or_else(|| ProxyError::InvalidHeader {
                header: "X-Ctxproxy-Budget",
                message: "expected a positive number of tokens".into(),
            }),
    }
}

/// The conversation's recall pairs put back where their re-asks put them (`recall::replay`),
/// counted in the tokens sent.
fn put_back(rewrite: &mut Rewrite, client: &ChatRequest, recalls: &[Mark], counter: &TokenCounter) {
    let prefix = rewrite.report.prefix.as_ref().map(Into::into);
    let sent = &mut rewrite.request.messages;
    let before = counter.messages(sent);
    if recall::replay(sent, &client.messages, prefix, recalls) > 0 {
        let added = counter.messages(sent).saturating_sub(before);
        rewrite.report.tokens_after += added;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads(body: serde_json::Value) -> StateReads {
        StateReads::of(&serde_json::from_value(body).unwrap())
    }

    #[test]
    fn a_first_request_asks_the_store_for_recalls_only_when_it_sends_tools() {
        let first = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}
        ]);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let none = StateReads {
            prefix: false,
            recall_marks: false,
        };
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": first})),
            none
        );
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": first, "tools": []})),
            none
        );
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": first, "tools": tools})),
            StateReads {
                prefix: false,
                recall_marks: true,
            }
        );
        let later = serde_json::json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}
        ]);
        let both = StateReads {
            prefix: true,
            recall_marks: true,
        };
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": later})),
            both
        );
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": later, "tools": tools})),
            both
        );
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": first, "tools": null})),
            none
        );
        // An assistant message before any user message is no earlier request.
        let greeting = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": "Hi"}
        ]);
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": greeting})),
            none
        );
        // A client tool named like the recall tool: the proxy never offers its own.
        let own =
            serde_json::json!([{"type": "function", "function": {"name": recall::TOOL_NAME}}]);
        assert_eq!(
            reads(serde_json::json!({"model": "m", "messages": first, "tools": own})),
            none
        );
    }
}
