from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "notifications"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The marketplace cannot import this app (it depends on the marketplace), so the app
        # hands the lifecycle its recorder: the outbox rows of a rental event are written in
        # the transaction that writes the event.
        from marketplace.lifecycle import event_recorder_register
        from notifications.services import RECORDED_STATUSES, rental_events_record

        event_recorder_register(rental_events_record, statuses=RECORDED_STATUSES)
