"""Drop-in APIs of other projects, on top of nanoinfer's engine."""
