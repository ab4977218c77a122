"""The advisor's API: memory per GPU, an estimate on a given card, plans from live offers, and
booking a plan in one step. Every number is bounded and checked; a bad one is a 400 naming it."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import permissions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.tenancy import request_team
from advisor import calibration, plans
from advisor import selectors as advisor_selectors
from advisor.engine.layouts import Run, default_topology, estimate
from advisor.engine.memory import (
    GB,
    USABLE_SHARE,
    Checkpointing,
    Layout,
    Optimizer,
    Precision,
    per_gpu,
)
from advisor.engine.presets import PRESETS, ModelShape, decoder_shape, params_mismatch, with_run
from advisor.engine.pricing import MAX_BOOKED_S
from advisor.engine.runs import layout_section, unrunnable
from core.api.fields import refuse_unknown
from core.errors import ValidationFailed
from marketplace import selectors
from marketplace.api.serializers import RentalDetailSerializer, RuntimeSerializer
from marketplace.models import GpuModel

MAX_GPUS = 100_000


class ModelSpecSerializer(serializers.Serializer):
    """The model: a preset, or a decoder's parameter count (its shape inferred unless given)."""

    model = serializers.ChoiceField(choices=sorted(PRESETS), required=False)
    params_b = serializers.FloatField(
        required=False, min_value=0.001, max_value=10_000, help_text="parameters, in billions"
    )
    layers = serializers.IntegerField(required=False, min_value=1, max_value=1000)
    hidden = serializers.IntegerField(required=False, min_value=1, max_value=131_072)
    heads = serializers.IntegerField(required=False, min_value=1, max_value=1024)
    kv_heads = serializers.IntegerField(
        required=False, min_value=1, max_value=1024, help_text="grouped-query attention heads"
    )
    ffn_hidden = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=1_048_576,
        help_text="the MLP width; default: the one that gives params_b",
    )
    seq_len = serializers.IntegerField(required=False, min_value=1, max_value=1_048_576)
    micro_batch = serializers.IntegerField(required=False, min_value=1, max_value=65_536)
    global_batch = serializers.IntegerField(
        required=False, min_value=1, max_value=10_000_000, help_text="sequences per step"
    )
    precision = serializers.ChoiceField(choices=list(Precision), default=Precision.BF16)
    optimizer = serializers.ChoiceField(
        choices=[*Optimizer, "adam"],
        default=Optimizer.ADAMW,
        help_text="adam is adamw (the same states: two fp32 moments)",
    )

    ALSO: frozenset[str] = frozenset()

    def validate_optimizer(self, value):
        # Adam and AdamW keep the same states; they differ only in how weight decay is applied.
        return Optimizer.ADAMW if value == "adam" else Optimizer(value)

    def validate(self, attrs):
        refuse_unknown(self, also=self.ALSO)
        if ("model" in attrs) == ("params_b" in attrs):
            raise serializers.ValidationError({"model": ["give a preset model or params_b"]})
        shape_fields = {"layers", "hidden", "heads", "kv_heads", "ffn_hidden"} & set(attrs)
        if "model" in attrs and shape_fields:
            field = sorted(shape_fields)[0]
            raise serializers.ValidationError({field: ["a preset has its own shape"]})
        if "hidden" in attrs and "heads" in attrs and attrs["hidden"] % attrs["heads"]:
            raise serializers.ValidationError({"heads": ["hidden must be divisible by heads"]})
        if "kv_heads" in attrs and attrs.get("heads", 1) % attrs["kv_heads"]:
            raise serializers.ValidationError({"kv_heads": ["must divide heads"]})
        attrs["shape"] = self._shape(attrs)
        mismatch = params_mismatch(attrs["shape"])
        if mismatch is not None:
            raise serializers.ValidationError({"params_b": [str(mismatch)]})
        if attrs["shape"].micro_batch > attrs["shape"].global_batch:
            raise serializers.ValidationError({"micro_batch": ["larger than global_batch"]})
        return attrs

    def run(self) -> Run:
        """The validated training run (for the serializers that take tokens_b)."""
        data = self.validated_data
        return Run(
            shape=data["shape"],
            tokens=data["tokens_b"] * 1e9,
            precision=Precision(data["precision"]),
            optimizer=Optimizer(data["optimizer"]),
            checkpointing=data.get("checkpointing"),
        )

    @staticmethod
    def _shape(attrs) -> ModelShape:
        if "model" in attrs:
            shape = PRESETS[attrs["model"]]
            return with_run(
                shape,
                seq_len=attrs.get("seq_len"),
                micro_batch=attrs.get("micro_batch"),
                global_batch=attrs.get("global_batch"),
            )
        return decoder_shape(
            params=attrs["params_b"] * 1e9,
            layers=attrs.get("layers"),
            hidden=attrs.get("hidden"),
            heads=attrs.get("heads"),
            kv_heads=attrs.get("kv_heads"),
            ffn_hidden=attrs.get("ffn_hidden"),
            seq_len=attrs.get("seq_len", 2048),
            global_batch=attrs.get("global_batch"),
            micro_batch=attrs.get("micro_batch", 1),
        )


class LayoutFieldsMixin(serializers.Serializer):
    dp = serializers.IntegerField(required=False, min_value=1, max_value=MAX_GPUS)
    tp = serializers.IntegerField(required=False, min_value=1, max_value=64)
    pp = serializers.IntegerField(required=False, min_value=1, max_value=1000)
    zero_stage = serializers.IntegerField(required=False, min_value=0, max_value=3)
    checkpointing = serializers.ChoiceField(choices=list(Checkpointing), required=False)

    def layout(self, attrs, *, gpus: int | None = None) -> Layout | None:
        """The layout asked for, or None when none of its fields were given (then chosen)."""
        given = {"dp", "tp", "pp", "zero_stage"} & set(attrs)
        if gpus is not None and not given:
            return None
        tp, pp = attrs.get("tp", 1), attrs.get("pp", 1)
        dp = attrs.get("dp", (gpus // (tp * pp)) if gpus else 1)
        shape = attrs["shape"]
        if gpus is not None and "dp" not in attrs:
            # dp follows from the others: a tp or pp that does not divide the GPUs is at fault.
            for name, label, value in (
                ("tp", "tp", tp),
                ("pp", "pp", pp),
                ("tp", "tp x pp", tp * pp),
            ):
                if gpus % value:
                    raise ValidationFailed(
                        f"{label} = {value} does not divide the {gpus} GPUs", field=name
                    )
        if gpus is not None and dp * tp * pp != gpus:
            raise ValidationFailed(f"dp x tp x pp = {dp * tp * pp}, not gpus ({gpus})", field="dp")
        if shape.heads % tp:
            raise ValidationFailed("tp must divide the number of heads", field="tp")
        if pp > shape.layers or shape.layers % pp:
            raise ValidationFailed("pp must divide the number of layers", field="pp")
        return Layout(
            dp=dp,
            tp=tp,
            pp=pp,
            zero_stage=attrs.get("zero_stage", 0),
            micro_batch=shape.micro_batch,
            checkpointing=attrs.get("checkpointing", Checkpointing.NONE),
        )


class MemoryQuerySerializer(LayoutFieldsMixin, ModelSpecSerializer):
    pass


class GbSerializer(serializers.Serializer):
    params = serializers.FloatField()
    grads = serializers.FloatField()
    optimizer = serializers.FloatField()
    activations = serializers.FloatField()
    total = serializers.FloatField()


class LayoutSerializer(serializers.Serializer):
    dp = serializers.IntegerField()
    tp = serializers.IntegerField()
    pp = serializers.IntegerField()
    zero_stage = serializers.IntegerField()
    micro_batch = serializers.IntegerField()
    checkpointing = serializers.CharField()


class HarnessLayoutSerializer(serializers.Serializer):
    dp = serializers.IntegerField()
    tp = serializers.IntegerField()
    pp = serializers.IntegerField()
    shard = serializers.ChoiceField(choices=["none", "zero2", "zero3"])
    recompute = serializers.ChoiceField(choices=list(Checkpointing))
    micro_batch = serializers.IntegerField()
    grad_accum = serializers.IntegerField()
    pp_schedule = serializers.CharField(required=False)
    pp_microbatches = serializers.IntegerField(required=False)


class MemoryAnswerSerializer(serializers.Serializer):
    per_gpu_gb = GbSerializer()
    layout = LayoutSerializer()


class EstimateQuerySerializer(LayoutFieldsMixin, ModelSpecSerializer):
    tokens_b = serializers.FloatField(
        min_value=1e-6, max_value=1_000_000, help_text="training tokens (images), in billions"
    )
    card = serializers.SlugField(max_length=40, help_text="a catalog slug")
    gpus = serializers.IntegerField(min_value=1, max_value=MAX_GPUS)

    def validate_card(self, value):
        if not GpuModel.objects.filter(slug=value).exists():
            raise serializers.ValidationError("not a card of the catalog")
        return value


class EstimateAnswerSerializer(serializers.Serializer):
    card = serializers.CharField()
    gpus = serializers.IntegerField()
    fits = serializers.BooleanField()
    message = serializers.CharField(allow_null=True, help_text="why there are no hours")
    hours = serializers.FloatField(allow_null=True, help_text="null when the run does not fit")
    gpu_hours = serializers.FloatField(allow_null=True)
    mfu = serializers.FloatField(help_text="model FLOPs (6 x params x tokens) over the dense peak")
    mfu_prior = serializers.FloatField(help_text="the card's share of peak, calibrated by runs")
    step_s = serializers.FloatField()
    tokens_per_s = serializers.FloatField()
    precision = serializers.CharField()
    layout = LayoutSerializer()
    per_gpu_gb = GbSerializer()


class AdvisorQuerySerializer(ModelSpecSerializer):
    tokens_b = serializers.FloatField(
        min_value=1e-6, max_value=1_000_000, help_text="training tokens (images), in billions"
    )
    checkpointing = serializers.ChoiceField(
        choices=list(Checkpointing), required=False, help_text="default: the least that fits"
    )
    deadline_hours = serializers.FloatField(required=False, min_value=0.01, max_value=1_000_000)
    budget = serializers.DecimalField(
        required=False, max_digits=14, decimal_places=2, min_value=1, help_text="in dollars"
    )
    interruptible = serializers.BooleanField(default=False)
    region = serializers.SlugField(max_length=40, required=False)

    ALSO = frozenset({"plan", "card", "name", "runtime", "dataset", "series", "resume_from"})

    def query(self) -> plans.Query:
        data = self.validated_data
        return plans.Query(
            run=self.run(),
            interruptible=data["interruptible"],
            deadline_hours=data.get("deadline_hours"),
            budget=data.get("budget"),
            region=data.get("region"),
            dataset=data.get("dataset"),
        )


class AdvisorBookSerializer(AdvisorQuerySerializer):
    plan = serializers.RegexField(
        r"^[a-z0-9-]{1,40}:[0-9]{1,4}x[0-9]{1,3}$",
        required=False,
        help_text="a plan's id (card:NODESxGPUS), re-priced now",
    )
    card = serializers.SlugField(
        max_length=40, required=False, help_text="or a card: its cheapest plan"
    )
    name = serializers.CharField(max_length=80, required=False, default="")
    runtime = RuntimeSerializer(required=False)
    dataset = serializers.SlugField(
        max_length=100,
        required=False,
        help_text="one of your team's ready datasets of token files (flat uint16 arrays, uint32 "
        "for a vocabulary over 65,536) the run trains on; default: the built-in tokens",
    )
    series = serializers.BooleanField(
        default=False,
        help_text="book a plan longer than one booking as the next booking of its series",
    )
    resume_from = serializers.UUIDField(
        required=False, help_text="the series' previous rental: its last checkpoint is resumed"
    )

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if ("plan" in attrs) == ("card" in attrs):
            raise serializers.ValidationError({"plan": ["give a plan id or a card"]})
        return attrs


class AccuracySerializer(serializers.Serializer):
    runs = serializers.IntegerField()
    median = serializers.FloatField(allow_null=True, help_text="measured / estimated step time")
    p90 = serializers.FloatField(allow_null=True)


class PlanSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="book it with advisor/book/ {plan: id}")
    card = serializers.CharField(source="estimate.card.slug")
    card_name = serializers.CharField(source="estimate.card.name")
    gpus = serializers.IntegerField(source="placement.gpus")
    gpus_per_node = serializers.IntegerField(source="placement.gpus_per_node")
    nodes = serializers.SerializerMethodField()
    interconnect = serializers.CharField(
        source="placement.interconnect",
        allow_null=True,
        help_text='the fabric between the nodes, "InfiniBand 400 Gb/s" (its bandwidth is what '
        "the plan is priced with); null on one node",
    )
    layout = serializers.SerializerMethodField()
    per_gpu_gb = serializers.SerializerMethodField()
    hours = serializers.FloatField()
    gpu_hours = serializers.FloatField()
    mfu = serializers.FloatField(source="estimate.mfu")
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    cost = serializers.DecimalField(
        max_digits=14, decimal_places=2, help_text="the estimated hours at the price"
    )
    booked_s = serializers.IntegerField(
        help_text="what booking it books: the estimate plus a fifth, whole minutes, >= 10 min"
    )
    booked_hours = serializers.FloatField()
    hold_micros = serializers.IntegerField(
        help_text="what booking it holds of the balance until it ends: booked time x price"
    )
    hold_usd = serializers.DecimalField(max_digits=20, decimal_places=6)
    interruptible = serializers.BooleanField()
    checkpoint_interval_s = serializers.FloatField(allow_null=True)
    bookings = serializers.IntegerField(
        help_text=f"1 for a run one booking holds; more: a series of bookings of at most "
        f"{MAX_BOOKED_S // 3600} h, each resuming from the checkpoint of the one before"
    )
    runs = serializers.SerializerMethodField(
        help_text="the harness config's layout section booking it runs"
    )
    flags = serializers.ListField(
        child=serializers.CharField(),
        help_text="cheapest, fastest, best_value: among the plans one booking holds",
    )
    notes = serializers.ListField(child=serializers.CharField())

    def get_nodes(self, plan) -> int:
        return len(plan.placement.offers)

    @extend_schema_field(LayoutSerializer)
    def get_layout(self, plan) -> dict:
        return plan.estimate.layout.to_dict()

    @extend_schema_field(GbSerializer)
    def get_per_gpu_gb(self, plan) -> dict:
        return plan.estimate.memory.gb()

    @extend_schema_field(HarnessLayoutSerializer)
    def get_runs(self, plan) -> dict:
        return layout_section(plan.estimate.layout, plan.estimate.step.micro_batches)


class AdvisorAnswerSerializer(serializers.Serializer):
    plans = PlanSerializer(many=True)
    reasons = serializers.ListField(
        child=serializers.CharField(), help_text="why cards or plans were left out"
    )
    accuracy = AccuracySerializer(help_text="the advisor's error on past runs")


def _estimate_answer(found) -> dict:
    usable = found.card.memory_gb * USABLE_SHARE
    return {
        "card": found.card.slug,
        "gpus": found.gpus,
        "fits": found.fits,
        # Hours of a run that cannot start are no answer: say what is short instead.
        "message": None
        if found.fits
        else (
            f"does not fit: {found.memory.total / GB:.1f} GB per GPU with the layout needing the "
            f"least, {usable:.1f} GB usable on a {found.card.memory_gb:g} GB card; add GPUs, "
            "shard (zero_stage 3) or recompute (checkpointing full)"
        ),
        "hours": found.hours if found.fits else None,
        "gpu_hours": found.gpu_hours if found.fits else None,
        "mfu": found.mfu,
        "mfu_prior": found.prior,
        "step_s": found.step.total,
        "tokens_per_s": found.tokens_per_s,
        "precision": str(found.precision),
        "layout": found.layout.to_dict(),
        "per_gpu_gb": found.memory.gb(),
    }


class AdvisorMemoryView(APIView):
    """Memory per GPU of a training run, by component, for a given layout."""

    permission_classes = [permissions.AllowAny]

    @extend_schema(request=MemoryQuerySerializer, responses=MemoryAnswerSerializer)
    def post(self, request: Request) -> Response:
        body = MemoryQuerySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        layout = body.layout(data)
        memory = per_gpu(
            shape=data["shape"],
            precision=Precision(data["precision"]),
            optimizer=Optimizer(data["optimizer"]),
            layout=layout,
        )
        return Response({"per_gpu_gb": memory.gb(), "layout": layout.to_dict()})


class AdvisorEstimateView(APIView):
    """Time and memory of a run on a number of GPUs of one card, no offers involved."""

    permission_classes = [permissions.AllowAny]

    @extend_schema(request=EstimateQuerySerializer, responses=EstimateAnswerSerializer)
    def post(self, request: Request) -> Response:
        body = EstimateQuerySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        card = advisor_selectors.advisor_card_get(data["card"])
        fixed = body.layout(data, gpus=data["gpus"])
        precision = card.precision_used(Precision(data["precision"]))
        why = fixed and unrunnable(data["shape"], fixed, precision)
        if why:
            raise ValidationFailed(
                f"the harness cannot run this layout: {why.reason}", field=why.field
            )
        found = estimate(body.run(), card, default_topology(card, data["gpus"]), fixed=fixed)
        if found is None:
            raise ValidationFailed(
                f"{data['gpus']} GPUs leave no layout: more replicas than the "
                f"{data['shape'].global_batch} sequences of a step",
                field="gpus",
            )
        return Response(_estimate_answer(found))


class AdvisorView(APIView):
    """Plans for a training run from the offers free now: cheapest, fastest, best value."""

    permission_classes = [permissions.AllowAny]

    @extend_schema(request=AdvisorQuerySerializer, responses=AdvisorAnswerSerializer)
    def post(self, request: Request) -> Response:
        body = AdvisorQuerySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        answer = plans.advise(body.query())
        return Response(
            {
                "plans": PlanSerializer(answer.plans, many=True).data,
                "reasons": answer.reasons,
                "accuracy": calibration.accuracy(),
            }
        )


class AdvisorAccuracyView(APIView):
    """The advisor's error on past runs: measured / estimated step time, median and p90."""

    permission_classes = [permissions.AllowAny]

    @extend_schema(responses=AccuracySerializer)
    def get(self, request: Request) -> Response:
        return Response(calibration.accuracy())


class AdvisorBookView(APIView):
    """Book a plan in one step: its card and gang are priced again on the offers free now."""

    @extend_schema(request=AdvisorBookSerializer, responses={201: RentalDetailSerializer})
    def post(self, request: Request) -> Response:
        body = AdvisorBookSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        team = request_team(request)
        rental = plans.plan_book(
            customer=request.user,
            team=team,
            query=body.query(),
            plan_id=data.get("plan"),
            card=data.get("card"),
            name=data["name"],
            runtime=data.get("runtime"),
            series=data["series"],
            resume_from=data.get("resume_from"),
        )
        rental = selectors.rental_get(team=team, rental_id=rental.pk)
        answer = dict(RentalDetailSerializer.for_instance(rental).data)
        bookings = (rental.advisor_estimate or {}).get("bookings", 1)
        if bookings > 1:
            answer["message"] = (
                f"one booking of a series of {bookings}: the run checkpoints as it goes; book the "
                f"next with series: true and resume_from: {rental.pk} to continue from its last "
                "checkpoint"
            )
        return Response(answer, status=status.HTTP_201_CREATED)
