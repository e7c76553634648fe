//! The Terraform plumbing of an object the engine manages, written once: a
//! resource says what is its own in [`ManagedObject`], and [`Managed`] turns
//! that into tf-provider's `Resource` (reading the state Terraform sends,
//! calling the engine, reading the object back after each change, diagnostics,
//! import by name).

use crate::common::*;
use async_trait::async_trait;
use lbscale_engine::model::Findings;
use lbscale_engine::{Engine, EngineError};
use serde::{de::DeserializeOwned, Serialize};
use std::marker::PhantomData;
use tf_provider::schema::{Block, Schema};
use tf_provider::value::{Value, ValueEmpty};
use tf_provider::{AttributePath, Diagnostics, Resource};

/// What one resource type declares about itself.
#[async_trait]
pub trait ManagedObject: Send + Sync + 'static {
    /// The resource's Terraform state.
    type State: Serialize + DeserializeOwned + Send + Sync;
    /// What the engine creates and updates the object from.
    type Spec: Send + Sync;
    /// The object's name in diagnostics: "create {KIND} failed", "Cannot import {KIND}".
    const KIND: &'static str;

    /// The schema's block; [`Managed`] gives it the schema version.
    fn schema() -> Block;
    /// The checks that need nothing but the configuration.
    fn validate(config: &Self::State) -> Findings;
    fn id(state: &Self::State) -> String;
    /// The typed spec of a planned state; `Err` names the attribute that does
    /// not read (which validation refuses earlier, once the value is known).
    fn spec_of(state: &Self::State) -> Result<Self::Spec, Findings>;

    /// Plans a new object in place: defaults, plan-time checks, and the computed
    /// attributes that only the apply knows (at least `id`) set unknown.
    fn plan_create(
        engine: &EngineHandle,
        diags: &mut Diagnostics,
        planned: &mut Self::State,
    ) -> Option<()>;
    /// Plans a change in place; returns the attributes whose change replaces the object.
    fn plan_update(
        engine: &EngineHandle,
        diags: &mut Diagnostics,
        prior: &Self::State,
        planned: &mut Self::State,
    ) -> Option<Vec<AttributePath>>;

    /// What a refresh, and an update that did not plan them unknown, leave as
    /// `last` has them: computed values that the object's own apply does not
    /// make (they move when other resources or the daemon act), so that a
    /// refresh never reports them as changed outside Terraform. `last` is the
    /// prior state on a refresh, the planned one on an update; only its known
    /// values are kept. Nothing by default.
    fn keep_from(_last: &Self::State, _now: &mut Self::State) {}

    /// The object as the engine sees it now; `None` when it is gone.
    async fn read(engine: &Engine, id: &str) -> Result<Option<Self::State>, EngineError>;
    /// The id of the object with this name (`terraform import` names objects by name).
    fn find(engine: &Engine, name: &str) -> Result<Option<String>, EngineError>;
    /// Creates the object; returns its id.
    async fn create(engine: &Engine, spec: &Self::Spec) -> Result<String, EngineError>;
    /// The work after `create` that can fail once the object exists. Nothing by default.
    async fn bring_up(_engine: &Engine, _id: &str) -> Result<(), EngineError> {
        Ok(())
    }
    async fn update(engine: &Engine, id: &str, spec: &Self::Spec) -> Result<(), EngineError>;
    async fn delete(engine: &Engine, id: &str) -> Result<(), EngineError>;
}

/// The tf-provider resource of a [`ManagedObject`].
pub struct Managed<T> {
    engine: EngineHandle,
    object: PhantomData<fn() -> T>,
}

impl<T: ManagedObject> Managed<T> {
    pub fn new(engine: EngineHandle) -> Self {
        Managed {
            engine,
            object: PhantomData,
        }
    }

    /// The state as the engine sees it now; `Null` when the object is gone.
    async fn observe(&self, diags: &mut Diagnostics, id: &str) -> Option<Value<T::State>> {
        let engine = engine(&self.engine, diags)?;
        let found = done(
            diags,
            &format!("read {}", T::KIND),
            T::read(&engine, id).await,
        )?;
        Some(found.into())
    }

    /// [`Managed::observe`], keeping what [`ManagedObject::keep_from`] says of `last`.
    async fn observe_after(
        &self,
        diags: &mut Diagnostics,
        id: &str,
        last: &T::State,
    ) -> Option<Value<T::State>> {
        let mut now = self.observe(diags, id).await?;
        if let Value::Value(now) = &mut now {
            T::keep_from(last, now);
        }
        Some(now)
    }
}

/// The spec, or its findings reported.
fn spec_or_report<S>(diags: &mut Diagnostics, spec: Result<S, Findings>) -> Option<S> {
    match spec {
        Ok(spec) => Some(spec),
        Err(findings) => {
            report(diags, findings);
            None
        }
    }
}

/// A state that deserialised as null where an object was expected.
fn missing_state(diags: &mut Diagnostics) {
    root_error(
        diags,
        "Missing state",
        "Terraform sent no state for this resource",
    )
}

#[async_trait]
impl<T: ManagedObject> Resource for Managed<T> {
    type State<'a> = Value<T::State>;
    type PrivateState<'a> = ValueEmpty;
    type ProviderMetaState<'a> = ValueEmpty;

    fn schema(&self, _diags: &mut Diagnostics) -> Option<Schema> {
        Some(Schema {
            version: 1,
            block: T::schema(),
        })
    }

    async fn validate<'a>(&self, diags: &mut Diagnostics, config: Self::State<'a>) -> Option<()> {
        let Some(c) = known(&config) else {
            return Some(());
        };
        report(diags, T::validate(c))
    }

    async fn read<'a>(
        &self,
        diags: &mut Diagnostics,
        state: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let Some(s) = known(&state) else {
            return Some((Value::Null, p));
        };
        Some((self.observe_after(diags, &T::id(s), s).await?, p))
    }

    async fn plan_create<'a>(
        &self,
        diags: &mut Diagnostics,
        proposed: Self::State<'a>,
        _config: Self::State<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let Value::Value(mut s) = proposed else {
            return Some((proposed, Value::Null));
        };
        T::plan_create(&self.engine, diags, &mut s)?;
        Some((Value::Value(s), Value::Null))
    }

    async fn plan_update<'a>(
        &self,
        diags: &mut Diagnostics,
        prior: Self::State<'a>,
        proposed: Self::State<'a>,
        _config: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>, Vec<AttributePath>)> {
        let (Value::Value(prior), Value::Value(mut s)) = (prior, proposed) else {
            missing_state(diags);
            return None;
        };
        let replace = T::plan_update(&self.engine, diags, &prior, &mut s)?;
        Some((Value::Value(s), p, replace))
    }

    async fn plan_destroy<'a>(
        &self,
        _diags: &mut Diagnostics,
        _prior: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<Self::PrivateState<'a>> {
        Some(p)
    }

    async fn create<'a>(
        &self,
        diags: &mut Diagnostics,
        planned: Self::State<'a>,
        _config: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let Some(s) = known(&planned) else {
            missing_state(diags);
            return None;
        };
        let engine = engine(&self.engine, diags)?;
        let what = format!("create {}", T::KIND);
        let spec = spec_or_report(diags, T::spec_of(s))?;
        let created = T::create(&engine, &spec).await;
        super::memo::wrote();
        let id = done(diags, &what, created)?;
        let brought_up = T::bring_up(&engine, &id).await;
        super::memo::wrote();
        let state = self.observe(diags, &id).await?;
        if let Err(e) = brought_up {
            // The object exists: hand its state back with the error, so that
            // Terraform records it as tainted and the next apply replaces it,
            // instead of forgetting what was created.
            engine_error(diags, &what, e);
        }
        Some((state, p))
    }

    async fn update<'a>(
        &self,
        diags: &mut Diagnostics,
        prior: Self::State<'a>,
        planned: Self::State<'a>,
        _config: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let (Some(prior), Some(s)) = (known(&prior), known(&planned)) else {
            missing_state(diags);
            return None;
        };
        let engine = engine(&self.engine, diags)?;
        let id = T::id(prior);
        let spec = spec_or_report(diags, T::spec_of(s))?;
        let updated = T::update(&engine, &id, &spec).await;
        super::memo::wrote();
        done(diags, &format!("update {}", T::KIND), updated)?;
        Some((self.observe_after(diags, &id, s).await?, p))
    }

    async fn destroy<'a>(
        &self,
        diags: &mut Diagnostics,
        prior: Self::State<'a>,
        _p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<()> {
        let Some(prior) = known(&prior) else {
            return Some(());
        };
        let engine = engine(&self.engine, diags)?;
        let deleted = T::delete(&engine, &T::id(prior)).await;
        super::memo::wrote();
        done(diags, &format!("destroy {}", T::KIND), deleted)
    }

    async fn import<'a>(
        &self,
        diags: &mut Diagnostics,
        name: String,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let engine = engine(&self.engine, diags)?;
        let id = import_id(diags, T::KIND, &name, T::find(&engine, &name))?;
        Some((self.observe(diags, &id).await?, Value::Null))
    }
}
